"""The native module (_ferry) and, in lib/ferry/plugins, the plugins it loads
(first in a child process: lib/ferry/ferry-probe).

This folder is laid out like an install prefix's lib/: the loader finds
plugins at <dir of the library>/../lib/ferry/plugins, which from here is
this folder's ferry/plugins. No environment variable is needed.
"""
