/* Logging, clocks, status names, and the load-time setup. */
#include "emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

int emu_debug_enabled;

void emu_log(const char *fmt, ...)
{
	char line[1024];
	va_list ap;
	int n;

	n = snprintf(line, sizeof(line), "ferry-verbs-emu[%d]: ", (int)getpid());
	if (n < 0 || (size_t)n >= sizeof(line))
		n = 0;
	va_start(ap, fmt);
	vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	/* One write per line so lines of concurrent processes do not mix. */
	size_t len = strlen(line);
	line[len++] = '\n';
	ssize_t w = write(STDERR_FILENO, line, len);
	(void)w;
}

uint64_t emu_now_ns(int clock)
{
	struct timespec ts;

	if (clock_gettime(clock, &ts))
		return 0;
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const char *const wc_status_names[] = {
	[IBV_WC_SUCCESS] = "SUCCESS",
	[IBV_WC_LOC_LEN_ERR] = "LOC_LEN_ERR",
	[IBV_WC_LOC_QP_OP_ERR] = "LOC_QP_OP_ERR",
	[IBV_WC_LOC_EEC_OP_ERR] = "LOC_EEC_OP_ERR",
	[IBV_WC_LOC_PROT_ERR] = "LOC_PROT_ERR",
	[IBV_WC_WR_FLUSH_ERR] = "WR_FLUSH_ERR",
	[IBV_WC_MW_BIND_ERR] = "MW_BIND_ERR",
	[IBV_WC_BAD_RESP_ERR] = "BAD_RESP_ERR",
	[IBV_WC_LOC_ACCESS_ERR] = "LOC_ACCESS_ERR",
	[IBV_WC_REM_INV_REQ_ERR] = "REM_INV_REQ_ERR",
	[IBV_WC_REM_ACCESS_ERR] = "REM_ACCESS_ERR",
	[IBV_WC_REM_OP_ERR] = "REM_OP_ERR",
	[IBV_WC_RETRY_EXC_ERR] = "RETRY_EXC_ERR",
	[IBV_WC_RNR_RETRY_EXC_ERR] = "RNR_RETRY_EXC_ERR",
	[IBV_WC_LOC_RDD_VIOL_ERR] = "LOC_RDD_VIOL_ERR",
	[IBV_WC_REM_INV_RD_REQ_ERR] = "REM_INV_RD_REQ_ERR",
	[IBV_WC_REM_ABORT_ERR] = "REM_ABORT_ERR",
	[IBV_WC_INV_EECN_ERR] = "INV_EECN_ERR",
	[IBV_WC_INV_EEC_STATE_ERR] = "INV_EEC_STATE_ERR",
	[IBV_WC_FATAL_ERR] = "FATAL_ERR",
	[IBV_WC_RESP_TIMEOUT_ERR] = "RESP_TIMEOUT_ERR",
	[IBV_WC_GENERAL_ERR] = "GENERAL_ERR",
};

const char *emu_wc_status_name(int status)
{
	if (status >= 0 &&
	    (size_t)status < sizeof(wc_status_names) / sizeof(wc_status_names[0]) &&
	    wc_status_names[status])
		return wc_status_names[status];
	return "UNKNOWN";
}

int emu_parse_wc_status(const char *name, int *status)
{
	if (strncasecmp(name, "IBV_WC_", 7) == 0)
		name += 7;
	for (size_t i = 0; i < sizeof(wc_status_names) / sizeof(wc_status_names[0]);
	     i++) {
		if (wc_status_names[i] && strcasecmp(name, wc_status_names[i]) == 0) {
			*status = (int)i;
			return 0;
		}
	}
	return EINVAL;
}

/*
 * At load: let any process of this user read and write our memory with
 * process_vm_readv/writev. Under Yama ptrace_scope=1 only ancestors may do
 * that unless the target names a ptracer; peers here are siblings. This
 * loosens protection only for processes that loaded this test double.
 */
__attribute__((constructor)) static void emu_on_load(void)
{
	const char *d = getenv("FERRY_VERBS_EMU_DEBUG");

	emu_debug_enabled = d && *d && strcmp(d, "0") != 0;
	if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0)
		emu_debug("prctl(PR_SET_PTRACER_ANY) failed (no Yama?): %s",
			  strerror(errno));
}

__attribute__((destructor)) static void emu_on_unload(void)
{
	emu_fabric_forget_self();
}
