/* A library a test plugin links against; the test deletes it afterwards so
 * the plugin needs a library the host lacks. */
__attribute__((visibility("default"))) int ferry_testdep_answer(void) { return 42; }
