/*
 * The emulated fabric: a directory (FERRY_VERBS_EMU_DIR, default
 * /dev/shm/ferry-verbs-emu-<uid>) holding what peers must see.
 *
 *   qp/<qpn:6 hex>        one queue pair: owner pid+start time, device GUID,
 *                         port, LID, GIDs, state, remote QPN, PD, access
 *   qp/<qpn>.err          a peer saw this QP violate access: it is in ERR
 *   mr/<rkey:8 hex>       one memory region: owner, PD, iova, length,
 *                         owner address, access, kind
 *   port/<guid>.<port>    an injected port-down, valid while its owner lives
 *   ctx/<guid>.<pid>.<start>.<n>.fifo
 *                         async event FIFO of one open device context
 *
 * Records are small "key=value" text files, written to a temporary file
 * and then link()ed (creation: fails if the name is taken, so QPNs and
 * rkeys are unique) or rename()d (update: readers see old or new, never a
 * torn record). A record whose owner is gone (pid not running, or running
 * with another start time) is stale and is swept when a process first
 * opens a device; a name is never reused while any file holds it.
 *
 * MR records are never rewritten. A peer holds flock(LOCK_SH) on the record
 * from validation to the end of its process_vm_* transfer; deregistration
 * takes LOCK_EX before unlinking, so once ibv_dereg_mr returns no peer is
 * still touching the memory (what a real HCA guarantees).
 */
#include "emu.h"

#include <dirent.h>
#include <signal.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t fabric_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- identity ----------------------------------------------------------- */

static unsigned long long start_time_of(pid_t pid)
{
	char path[64], buf[1024], *p;
	unsigned long long start = 0;
	int fd;
	ssize_t n;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	/* comm may contain spaces and parentheses: fields restart after the
	 * last ')'. There, field 3 (state) comes first; start time is 22. */
	p = strrchr(buf, ')');
	if (!p)
		return 0;
	p++;
	/* A zombie (Z) or dead (X) process has no memory to reach. */
	if (p[0] == ' ' && (p[1] == 'Z' || p[1] == 'X'))
		return 0;
	for (int field = 3; field < 22 && p; field++) {
		p = strchr(p + 1, ' ');
	}
	if (!p || sscanf(p, " %llu", &start) != 1)
		return 0;
	return start;
}

struct emu_owner emu_self(void)
{
	static pid_t cached_pid;
	static unsigned long long cached_start;
	pid_t pid = getpid();

	/* Recomputed after fork(): the child is a different owner. */
	if (__atomic_load_n(&cached_pid, __ATOMIC_ACQUIRE) != pid) {
		cached_start = start_time_of(pid);
		__atomic_store_n(&cached_pid, pid, __ATOMIC_RELEASE);
	}
	return (struct emu_owner){ .pid = pid, .start = cached_start };
}

int emu_owner_alive(const struct emu_owner *o)
{
	if (o->pid <= 0)
		return 0;
	return start_time_of(o->pid) == o->start && o->start != 0;
}

/* ---- paths and records -------------------------------------------------- */

static void fpath(char *buf, size_t len, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void fpath(char *buf, size_t len, const char *fmt, ...)
{
	va_list ap;
	int n = snprintf(buf, len, "%s/", emu_g.fabric_dir);

	if (n < 0 || (size_t)n >= len) {
		buf[0] = '\0';
		return;
	}
	va_start(ap, fmt);
	vsnprintf(buf + n, len - (size_t)n, fmt, ap);
	va_end(ap);
}

static int write_tmp(const char *text, char *tmp, size_t tmplen)
{
	static unsigned counter;
	unsigned c = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
	size_t len = strlen(text);
	int fd;

	fpath(tmp, tmplen, ".tmp-%d-%u", (int)getpid(), c);
	fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0)
		return errno;
	if (write(fd, text, len) != (ssize_t)len) {
		int e = errno ? errno : EIO;
		close(fd);
		unlink(tmp);
		return e;
	}
	close(fd);
	return 0;
}

static int read_text(const char *path, char *buf, size_t len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n;

	if (fd < 0)
		return errno;
	n = read(fd, buf, len - 1);
	close(fd);
	if (n < 0)
		return errno;
	buf[n] = '\0';
	return 0;
}

/* Finds "key=" at a line start; returns the value (up to newline) or NULL. */
static const char *field(const char *text, const char *key, char *out, size_t len)
{
	size_t kl = strlen(key);
	const char *p = text;

	while (p && *p) {
		if (!strncmp(p, key, kl) && p[kl] == '=') {
			const char *v = p + kl + 1, *e = strchr(v, '\n');
			size_t n = e ? (size_t)(e - v) : strlen(v);
			if (n >= len)
				return NULL;
			memcpy(out, v, n);
			out[n] = '\0';
			return out;
		}
		p = strchr(p, '\n');
		if (p)
			p++;
	}
	return NULL;
}

static int field_u64(const char *text, const char *key, uint64_t *v)
{
	char buf[64], *end;

	if (!field(text, key, buf, sizeof(buf)))
		return EINVAL;
	errno = 0;
	*v = strtoull(buf, &end, 0);
	return errno || *end ? EINVAL : 0;
}

static int parse_owner(const char *text, struct emu_owner *o)
{
	uint64_t pid, start;

	if (field_u64(text, "pid", &pid) || field_u64(text, "start", &start))
		return EINVAL;
	o->pid = (pid_t)pid;
	o->start = start;
	return 0;
}

static int owner_of_file(const char *path, struct emu_owner *o)
{
	char text[2048];
	int err = read_text(path, text, sizeof(text));

	return err ? err : parse_owner(text, o);
}

static uint32_t random_u32(void)
{
	uint32_t v;

	if (getrandom(&v, sizeof(v), GRND_NONBLOCK) == sizeof(v))
		return v;
	return (uint32_t)emu_now_ns(CLOCK_MONOTONIC) ^ (uint32_t)getpid() * 2654435761u;
}

/* Creates name (from fmt_of(candidate)) exclusively with `text`. */
static int alloc_name(const char *dir, const char *text, uint32_t (*next)(void),
		      const char *fmt, uint32_t *out)
{
	char tmp[PATH_MAX], final[PATH_MAX];
	int err = write_tmp(text, tmp, sizeof(tmp));

	if (err)
		return err;
	for (int attempt = 0; attempt < 4096; attempt++) {
		uint32_t cand = next();
		char name[32];
		snprintf(name, sizeof(name), fmt, cand);
		fpath(final, sizeof(final), "%s/%s", dir, name);
		if (link(tmp, final) == 0) {
			unlink(tmp);
			*out = cand;
			return 0;
		}
		if (errno != EEXIST) {
			err = errno;
			unlink(tmp);
			return err;
		}
	}
	unlink(tmp);
	return ENOSPC;
}

static int replace_file(const char *final, const char *text)
{
	char tmp[PATH_MAX];
	int err = write_tmp(text, tmp, sizeof(tmp));

	if (err)
		return err;
	if (rename(tmp, final)) {
		err = errno;
		unlink(tmp);
		return err;
	}
	return 0;
}

/* ---- setup and sweeping ------------------------------------------------- */

static int mkdir_p(const char *path)
{
	char buf[PATH_MAX];
	size_t len = strlen(path);

	if (len == 0 || len >= sizeof(buf))
		return EINVAL;
	memcpy(buf, path, len + 1);
	for (char *p = buf + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(buf, 0700) && errno != EEXIST)
			return errno;
		*p = '/';
	}
	if (mkdir(buf, 0700) && errno != EEXIST)
		return errno;
	return 0;
}

/* Removes the entries of dead owners, or (mine) those of this process. */
static void sweep_dir(const char *sub, int mine)
{
	struct emu_owner me = emu_self();
	char dir[PATH_MAX], path[PATH_MAX + 300];
	DIR *d;
	struct dirent *e;

	fpath(dir, sizeof(dir), "%s", sub);
	d = opendir(dir);
	if (!d)
		return;
	while ((e = readdir(d))) {
		struct emu_owner o = { 0 };
		const char *n = e->d_name;
		int pid;
		unsigned long long start;
		char guid[32];

		if (!strcmp(n, ".") || !strcmp(n, ".."))
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, n);
		if (!strcmp(sub, "ctx")) {
			if (sscanf(n, "%16[0-9a-f].%d.%llu.", guid, &pid, &start) != 3)
				continue;
			o.pid = pid;
			o.start = start;
		} else if (strstr(n, ".err")) {
			char base[PATH_MAX + 300];
			snprintf(base, sizeof(base), "%s", path);
			*strstr(base, ".err") = '\0';
			/* a marker outlives its QP only by accident */
			if (access(base, F_OK) != 0 ||
			    (mine && !owner_of_file(base, &o) && o.pid == me.pid &&
			     o.start == me.start))
				unlink(path);
			continue;
		} else if (owner_of_file(path, &o)) {
			continue; /* being written, or not ours to judge */
		}
		if (mine) {
			if (o.pid == me.pid && o.start == me.start)
				unlink(path);
		} else if (!emu_owner_alive(&o)) {
			emu_debug("sweeping stale %s/%s (pid %d gone)", sub, n, (int)o.pid);
			unlink(path);
		}
	}
	closedir(d);
}

static void sweep_tmp(void)
{
	DIR *d = opendir(emu_g.fabric_dir);
	struct dirent *e;
	char path[PATH_MAX + 300];
	int pid;

	if (!d)
		return;
	while ((e = readdir(d))) {
		if (sscanf(e->d_name, ".tmp-%d-", &pid) == 1 && kill(pid, 0) != 0 &&
		    errno == ESRCH) {
			snprintf(path, sizeof(path), "%s/%s", emu_g.fabric_dir,
				 e->d_name);
			unlink(path);
		}
	}
	closedir(d);
}

int emu_fabric_prepare(void)
{
	static const char *const subs[] = { "qp", "mr", "port", "ctx" };
	struct stat st;
	int err = 0;

	pthread_mutex_lock(&fabric_lock);
	if (emu_g.fabric_ready)
		goto out;
	err = mkdir_p(emu_g.fabric_dir);
	if (err) {
		emu_log("cannot create fabric directory %s: %s", emu_g.fabric_dir,
			strerror(err));
		goto out;
	}
	if (lstat(emu_g.fabric_dir, &st) || !S_ISDIR(st.st_mode) ||
	    st.st_uid != getuid()) {
		emu_log("fabric directory %s is not a directory owned by uid %u; "
			"set FERRY_VERBS_EMU_DIR",
			emu_g.fabric_dir, (unsigned)getuid());
		err = EACCES;
		goto out;
	}
	for (size_t i = 0; i < sizeof(subs) / sizeof(subs[0]); i++) {
		char p[PATH_MAX];
		fpath(p, sizeof(p), "%s", subs[i]);
		if (mkdir(p, 0700) && errno != EEXIST) {
			err = errno;
			emu_log("cannot create %s: %s", p, strerror(err));
			goto out;
		}
	}
	for (size_t i = 0; i < sizeof(subs) / sizeof(subs[0]); i++)
		sweep_dir(subs[i], 0);
	sweep_tmp();
	emu_g.fabric_ready = 1;
out:
	pthread_mutex_unlock(&fabric_lock);
	return err;
}

/* At a normal exit our records leave with us; after a crash they are
 * stale until the next process sweeps them. The .err markers of our QPs
 * are swept first, then the records. */
void emu_fabric_forget_self(void)
{
	static const char *const subs[] = { "mr", "port", "ctx", "qp" };

	if (!emu_g.fabric_ready)
		return;
	for (size_t i = 0; i < sizeof(subs) / sizeof(subs[0]); i++)
		sweep_dir(subs[i], 1);
}

/* ---- queue pairs -------------------------------------------------------- */

static void format_qp(char *buf, size_t len, const struct emu_qp_rec *r)
{
	int n = snprintf(buf, len,
			 "pid=%d\nstart=%llu\nfifo=%s\nguid=0x%016llx\nport=%d\n"
			 "lid=%u\nlink_layer=%u\nstate=%d\ndest_qpn=0x%06x\npd=%u\n"
			 "access=0x%x\ngids=",
			 (int)r->owner.pid, r->owner.start, r->fifo,
			 (unsigned long long)r->guid, r->port, r->lid,
			 r->link_layer, r->state, r->dest_qpn, r->pd, r->access);
	for (int i = 0; i < r->ngids && n > 0 && (size_t)n < len; i++) {
		n += snprintf(buf + n, len - (size_t)n, "%s", i ? "," : "");
		for (int b = 0; b < 16 && (size_t)n < len; b++)
			n += snprintf(buf + n, len - (size_t)n, "%02x",
				      r->gids[i].raw[b]);
	}
	if (n > 0 && (size_t)n < len - 1)
		snprintf(buf + n, len - (size_t)n, "\n");
}

static uint32_t next_qpn(void)
{
	return 0x100 + random_u32() % (0xffffff - 0x100);
}

int emu_fabric_alloc_qpn(const struct emu_qp_rec *rec, uint32_t *qpn)
{
	char text[2048];

	format_qp(text, sizeof(text), rec);
	return alloc_name("qp", text, next_qpn, "%06x", qpn);
}

int emu_fabric_write_qp(uint32_t qpn, const struct emu_qp_rec *rec)
{
	char text[2048], final[PATH_MAX];

	format_qp(text, sizeof(text), rec);
	fpath(final, sizeof(final), "qp/%06x", qpn);
	return replace_file(final, text);
}

int emu_fabric_read_qp(uint32_t qpn, struct emu_qp_rec *r)
{
	char path[PATH_MAX], text[2048], buf[EMU_MAX_GIDS * 33 + 8];
	uint64_t v;
	int err;

	fpath(path, sizeof(path), "qp/%06x", qpn & 0xffffff);
	err = read_text(path, text, sizeof(text));
	if (err)
		return err;
	memset(r, 0, sizeof(*r));
	if (parse_owner(text, &r->owner) ||
	    !field(text, "fifo", r->fifo, sizeof(r->fifo)))
		return EINVAL;
	if (field_u64(text, "guid", &v))
		return EINVAL;
	r->guid = v;
	if (field_u64(text, "port", &v))
		return EINVAL;
	r->port = (int)v;
	if (field_u64(text, "lid", &v))
		return EINVAL;
	r->lid = (uint16_t)v;
	if (field_u64(text, "link_layer", &v))
		return EINVAL;
	r->link_layer = (uint8_t)v;
	if (field_u64(text, "state", &v))
		return EINVAL;
	r->state = (int)v;
	if (field_u64(text, "dest_qpn", &v))
		return EINVAL;
	r->dest_qpn = (uint32_t)v;
	if (field_u64(text, "pd", &v))
		return EINVAL;
	r->pd = (uint32_t)v;
	if (field_u64(text, "access", &v))
		return EINVAL;
	r->access = (unsigned)v;
	if (!field(text, "gids", buf, sizeof(buf)))
		return EINVAL;
	for (char *p = buf; *p && r->ngids < EMU_MAX_GIDS;) {
		for (int b = 0; b < 16; b++) {
			unsigned x;
			if (sscanf(p + 2 * b, "%2x", &x) != 1)
				return EINVAL;
			r->gids[r->ngids].raw[b] = (uint8_t)x;
		}
		r->ngids++;
		p += 32;
		if (*p == ',')
			p++;
	}
	return 0;
}

void emu_fabric_remove_qp(uint32_t qpn)
{
	char path[PATH_MAX];

	fpath(path, sizeof(path), "qp/%06x.err", qpn);
	unlink(path);
	fpath(path, sizeof(path), "qp/%06x", qpn);
	unlink(path);
}

int emu_fabric_qp_error_marked(uint32_t qpn)
{
	char path[PATH_MAX];

	fpath(path, sizeof(path), "qp/%06x.err", qpn & 0xffffff);
	return access(path, F_OK) == 0;
}

void emu_fabric_mark_qp_error(uint32_t qpn, const char *why)
{
	char path[PATH_MAX];
	int fd;

	fpath(path, sizeof(path), "qp/%06x.err", qpn & 0xffffff);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd >= 0) {
		ssize_t w = write(fd, why, strlen(why));
		(void)w;
		close(fd);
	}
}

void emu_fabric_clear_qp_error(uint32_t qpn)
{
	char path[PATH_MAX];

	fpath(path, sizeof(path), "qp/%06x.err", qpn);
	unlink(path);
}

/* ---- memory regions ----------------------------------------------------- */

static uint32_t next_rkey(void)
{
	uint32_t v;

	do
		v = random_u32();
	while (v == 0 || v == UINT32_MAX);
	return v;
}

int emu_fabric_alloc_rkey(const struct emu_mr_rec *r, uint32_t *rkey)
{
	char text[512];

	snprintf(text, sizeof(text),
		 "pid=%d\nstart=%llu\npd=%u\niova=0x%llx\nlength=0x%llx\n"
		 "host=0x%llx\naccess=0x%x\nkind=%d\n",
		 (int)r->owner.pid, r->owner.start, r->pd,
		 (unsigned long long)r->iova, (unsigned long long)r->length,
		 (unsigned long long)r->host, r->access, r->kind);
	return alloc_name("mr", text, next_rkey, "%08x", rkey);
}

/* flock with a deadline: nothing in this library may block forever. */
static int flock_bounded(int fd, int op, int timeout_ms)
{
	uint64_t deadline = emu_now_ns(CLOCK_MONOTONIC) +
			    (uint64_t)timeout_ms * 1000000ull;
	struct timespec nap = { 0, 100000 };

	for (;;) {
		if (flock(fd, op | LOCK_NB) == 0)
			return 0;
		if (errno != EWOULDBLOCK && errno != EINTR)
			return errno;
		if (emu_now_ns(CLOCK_MONOTONIC) > deadline)
			return ETIMEDOUT;
		nanosleep(&nap, NULL);
	}
}

int emu_fabric_lock_mr(uint32_t rkey, struct emu_mr_rec *r, int *out_fd)
{
	char path[PATH_MAX], text[512];
	struct stat st;
	uint64_t v;
	ssize_t n;
	int fd, err;

	fpath(path, sizeof(path), "mr/%08x", rkey);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno;
	err = flock_bounded(fd, LOCK_SH, 2000);
	if (err)
		goto fail;
	/* Deregistered between our open() and the lock: gone. */
	if (fstat(fd, &st) || st.st_nlink == 0) {
		err = ENOENT;
		goto fail;
	}
	n = pread(fd, text, sizeof(text) - 1, 0);
	if (n <= 0) {
		err = EINVAL;
		goto fail;
	}
	text[n] = '\0';
	memset(r, 0, sizeof(*r));
	err = EINVAL;
	if (parse_owner(text, &r->owner))
		goto fail;
	if (field_u64(text, "pd", &v))
		goto fail;
	r->pd = (uint32_t)v;
	if (field_u64(text, "iova", &r->iova) || field_u64(text, "length", &r->length) ||
	    field_u64(text, "host", &r->host))
		goto fail;
	if (field_u64(text, "access", &v))
		goto fail;
	r->access = (unsigned)v;
	if (field_u64(text, "kind", &v))
		goto fail;
	r->kind = (int)v;
	*out_fd = fd;
	return 0;
fail:
	close(fd);
	return err;
}

void emu_fabric_remove_mr(uint32_t rkey)
{
	char path[PATH_MAX];
	int fd, err;

	fpath(path, sizeof(path), "mr/%08x", rkey);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return;
	/* Wait for peers inside a transfer to this MR (each holds LOCK_SH for
	 * one bounded process_vm_* call). */
	err = flock_bounded(fd, LOCK_EX, 10000);
	if (err)
		emu_log("warning: deregistering rkey 0x%08x while a peer may still "
			"access it (%s)",
			rkey, strerror(err));
	unlink(path);
	close(fd);
}

/* ---- ports -------------------------------------------------------------- */

int emu_fabric_port_down(uint64_t guid, int port)
{
	char path[PATH_MAX];
	struct emu_owner o;

	if (!emu_g.fabric_ready)
		return 0;
	fpath(path, sizeof(path), "port/%016llx.%d", (unsigned long long)guid, port);
	if (owner_of_file(path, &o))
		return 0;
	return emu_owner_alive(&o);
}

void emu_fabric_set_port_down(uint64_t guid, int port)
{
	char path[PATH_MAX], text[128];
	struct emu_owner me = emu_self();

	fpath(path, sizeof(path), "port/%016llx.%d", (unsigned long long)guid, port);
	snprintf(text, sizeof(text), "pid=%d\nstart=%llu\n", (int)me.pid, me.start);
	replace_file(path, text);
}

/* ---- async event FIFOs -------------------------------------------------- */

struct emu_event_rec {
	uint32_t type;
	uint32_t num;
};

int emu_fabric_make_fifo(uint64_t guid, unsigned ctx_no, char *name, size_t len,
			 int *fd)
{
	char path[PATH_MAX];
	struct emu_owner me = emu_self();

	snprintf(name, len, "%016llx.%d.%llu.%u.fifo", (unsigned long long)guid,
		 (int)me.pid, me.start, ctx_no);
	fpath(path, sizeof(path), "ctx/%s", name);
	unlink(path);
	if (mkfifo(path, 0600))
		return errno;
	/* O_RDWR: we hold a writer ourselves, so reads never see EOF. */
	*fd = open(path, O_RDWR | O_CLOEXEC);
	if (*fd < 0) {
		int e = errno;
		unlink(path);
		return e;
	}
	return 0;
}

void emu_fabric_remove_fifo(const char *name)
{
	char path[PATH_MAX];

	fpath(path, sizeof(path), "ctx/%s", name);
	unlink(path);
}

void emu_fabric_send_event(const char *fifo, uint32_t type, uint32_t num)
{
	char path[PATH_MAX];
	struct emu_event_rec rec = { type, num };
	int fd;

	if (!fifo[0] || strchr(fifo, '/'))
		return;
	fpath(path, sizeof(path), "ctx/%s", fifo);
	/* Never blocks: no reader -> ENXIO, full FIFO -> EAGAIN; both drop the
	 * event, which a real HCA would also lose once its EQ overflows. */
	fd = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return;
	ssize_t w = write(fd, &rec, sizeof(rec));
	(void)w;
	close(fd);
}

void emu_fabric_broadcast_port_event(uint64_t guid, uint32_t type, uint32_t port)
{
	char dir[PATH_MAX], prefix[24];
	DIR *d;
	struct dirent *e;

	fpath(dir, sizeof(dir), "ctx");
	snprintf(prefix, sizeof(prefix), "%016llx.", (unsigned long long)guid);
	d = opendir(dir);
	if (!d)
		return;
	while ((e = readdir(d)))
		if (!strncmp(e->d_name, prefix, strlen(prefix)))
			emu_fabric_send_event(e->d_name, type, port);
	closedir(d);
}

/* ---- our own address space ---------------------------------------------- */

/* 0 if [start, start+len) is mapped readable (and writable if asked), else
 * EFAULT, like the kernel's page pinning in ibv_reg_mr. */
int emu_range_mapped(uintptr_t start, size_t len, int need_write)
{
	FILE *f;
	char line[512];
	uintptr_t cur = start, end = start + len;
	int ok = 0;

	if (len == 0 || end < start)
		return EFAULT;
	f = fopen("/proc/self/maps", "re");
	if (!f)
		return 0; /* cannot tell; let process_vm_* report faults later */
	while (fgets(line, sizeof(line), f)) {
		unsigned long lo, hi;
		char perms[8];
		if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3)
			continue;
		if (hi <= cur)
			continue;
		if (lo > cur)
			break; /* hole */
		if (perms[0] != 'r' || (need_write && perms[1] != 'w'))
			break;
		cur = hi;
		if (cur >= end) {
			ok = 1;
			break;
		}
	}
	fclose(f);
	return ok ? 0 : EFAULT;
}
