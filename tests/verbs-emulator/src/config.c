/*
 * Devices from FERRY_VERBS_EMU_CONFIG and faults from FERRY_VERBS_EMU_FAULTS.
 * The formats are described in README.md. A bad file or fault spec makes
 * ibv_get_device_list fail with EINVAL and a message naming the line; an
 * unset variable means a host with the library but no RDMA device.
 */
#include "emu.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

struct emu_global emu_g = {
	.init_lock = PTHREAD_MUTEX_INITIALIZER,
};

/* What the file set explicitly, so defaults can fill the rest. */
struct dev_seen {
	int guid, lid[EMU_MAX_PORTS + 1];
	int max_port_key;
};

static char *trim(char *s)
{
	char *e;

	while (isspace((unsigned char)*s))
		s++;
	e = s + strlen(s);
	while (e > s && isspace((unsigned char)e[-1]))
		*--e = '\0';
	return s;
}

static int parse_u64(const char *s, uint64_t *out)
{
	char *end;

	if (!*s)
		return EINVAL;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 0);
	if (errno || *end)
		return EINVAL;
	*out = v;
	return 0;
}

static int parse_guid(const char *s, uint64_t *out)
{
	unsigned a, b, c, d;
	char tail;

	if (sscanf(s, "%4x:%4x:%4x:%4x%c", &a, &b, &c, &d, &tail) == 4) {
		*out = ((uint64_t)a << 48) | ((uint64_t)b << 32) |
		       ((uint64_t)c << 16) | d;
		return 0;
	}
	return parse_u64(s, out);
}

static int parse_bool(const char *s, int *out)
{
	if (!strcasecmp(s, "yes") || !strcasecmp(s, "true") || !strcmp(s, "1") ||
	    !strcasecmp(s, "on")) {
		*out = 1;
		return 0;
	}
	if (!strcasecmp(s, "no") || !strcasecmp(s, "false") || !strcmp(s, "0") ||
	    !strcasecmp(s, "off")) {
		*out = 0;
		return 0;
	}
	return EINVAL;
}

static int parse_pci(const char *s, char *out, size_t len)
{
	unsigned dom, bus, dev, fn;
	char tail;

	if (sscanf(s, "%4x:%2x:%2x.%1x%c", &dom, &bus, &dev, &fn, &tail) != 4 ||
	    dev > 0x1f || fn > 7 || strlen(s) != 12)
		return EINVAL;
	snprintf(out, len, "%04x:%02x:%02x.%x", dom, bus, dev, fn);
	return 0;
}

struct name_val {
	const char *name;
	int val;
};

static int lookup(const struct name_val *t, const char *s, int *out)
{
	for (; t->name; t++) {
		if (!strcasecmp(t->name, s)) {
			*out = t->val;
			return 0;
		}
	}
	return EINVAL;
}

static const struct name_val port_states[] = {
	{ "DOWN", IBV_PORT_DOWN },   { "INIT", IBV_PORT_INIT },
	{ "ARMED", IBV_PORT_ARMED }, { "ACTIVE", IBV_PORT_ACTIVE },
	{ NULL, 0 },
};
static const struct name_val link_layers[] = {
	{ "InfiniBand", IBV_LINK_LAYER_INFINIBAND },
	{ "IB", IBV_LINK_LAYER_INFINIBAND },
	{ "Ethernet", IBV_LINK_LAYER_ETHERNET },
	{ "RoCE", IBV_LINK_LAYER_ETHERNET },
	{ NULL, 0 },
};
static const struct name_val mtus[] = {
	{ "256", IBV_MTU_256 },   { "512", IBV_MTU_512 },
	{ "1024", IBV_MTU_1024 }, { "2048", IBV_MTU_2048 },
	{ "4096", IBV_MTU_4096 }, { NULL, 0 },
};
/* ibv_port_attr.active_speed codes */
static const struct name_val speeds[] = {
	{ "SDR", 1 },  { "DDR", 2 },  { "QDR", 4 },  { "FDR10", 8 },
	{ "FDR", 16 }, { "EDR", 32 }, { "HDR", 64 }, { "NDR", 128 },
	{ NULL, 0 },
};
/* ibv_port_attr.active_width codes */
static const struct name_val widths[] = {
	{ "1X", 1 }, { "2X", 16 }, { "4X", 2 }, { "8X", 4 }, { "12X", 8 },
	{ NULL, 0 },
};
static const struct name_val gid_types[] = {
	{ "IB", IBV_GID_TYPE_IB },
	{ "RoCEv1", IBV_GID_TYPE_ROCE_V1 },
	{ "RoCEv2", IBV_GID_TYPE_ROCE_V2 },
	{ NULL, 0 },
};

static void default_device(struct emu_device *d, int index)
{
	memset(d, 0, sizeof(*d));
	d->index = index;
	d->dmabuf = 1;
	d->vendor_id = 0x02c9;     /* Mellanox */
	d->vendor_part_id = 4129;  /* ConnectX-7 */
	snprintf(d->fw_ver, sizeof(d->fw_ver), "28.39.1002");
	d->port_count = 1;
	d->fault.port_down_after = -1;
	d->fault.port_down_port = 1;
	d->fault.wc_error_status = IBV_WC_RETRY_EXC_ERR;
	for (int p = 1; p <= EMU_MAX_PORTS; p++) {
		struct emu_port_cfg *pc = &d->ports[p];
		pc->state = IBV_PORT_ACTIVE;
		pc->link_layer = IBV_LINK_LAYER_INFINIBAND;
		pc->active_mtu = IBV_MTU_4096;
		pc->active_speed = 128; /* NDR */
		pc->active_width = 2;   /* 4X */
	}
}

static int valid_name(const char *s)
{
	size_t n = strlen(s);

	if (n == 0 || n >= IBV_SYSFS_NAME_MAX)
		return 0;
	for (; *s; s++)
		if (!isalnum((unsigned char)*s) && *s != '_' && *s != '-')
			return 0;
	return 1;
}

static int set_key(struct emu_device *d, struct dev_seen *seen, const char *key,
		   const char *val)
{
	uint64_t u;
	int v, p;
	char rest[64];

	if (!strcmp(key, "pci"))
		return parse_pci(val, d->pci, sizeof(d->pci));
	if (!strcmp(key, "guid") || !strcmp(key, "node_guid")) {
		seen->guid = 1;
		return parse_guid(val, &d->node_guid);
	}
	if (!strcmp(key, "ports")) {
		if (parse_u64(val, &u) || u < 1 || u > EMU_MAX_PORTS)
			return EINVAL;
		d->port_count = (int)u;
		return 0;
	}
	if (!strcmp(key, "dmabuf"))
		return parse_bool(val, &d->dmabuf);
	if (!strcmp(key, "vendor_id")) {
		if (parse_u64(val, &u) || u > UINT32_MAX)
			return EINVAL;
		d->vendor_id = (uint32_t)u;
		return 0;
	}
	if (!strcmp(key, "vendor_part_id")) {
		if (parse_u64(val, &u) || u > UINT32_MAX)
			return EINVAL;
		d->vendor_part_id = (uint32_t)u;
		return 0;
	}
	if (!strcmp(key, "fw_ver")) {
		if (strlen(val) >= sizeof(d->fw_ver))
			return EINVAL;
		snprintf(d->fw_ver, sizeof(d->fw_ver), "%s", val);
		return 0;
	}
	/* port<N>.<attr> */
	if (sscanf(key, "port%d.%63s", &p, rest) != 2 || p < 1 ||
	    p > EMU_MAX_PORTS)
		return ENOENT;
	if (p > seen->max_port_key)
		seen->max_port_key = p;
	struct emu_port_cfg *pc = &d->ports[p];
	if (!strcmp(rest, "state"))
		return lookup(port_states, val, &pc->state);
	if (!strcmp(rest, "link_layer")) {
		if (lookup(link_layers, val, &v))
			return EINVAL;
		pc->link_layer = (uint8_t)v;
		return 0;
	}
	if (!strcmp(rest, "lid")) {
		if (parse_u64(val, &u) || u > 0xbfff)
			return EINVAL;
		pc->lid = (uint16_t)u;
		seen->lid[p] = 1;
		return 0;
	}
	if (!strcmp(rest, "mtu"))
		return lookup(mtus, val, &pc->active_mtu);
	if (!strcmp(rest, "speed")) {
		if (lookup(speeds, val, &v))
			return EINVAL;
		pc->active_speed = (uint8_t)v;
		return 0;
	}
	if (!strcmp(rest, "width")) {
		if (lookup(widths, val, &v))
			return EINVAL;
		pc->active_width = (uint8_t)v;
		return 0;
	}
	int gi;
	char tail;
	if (sscanf(rest, "gid%d%c", &gi, &tail) == 1) {
		char buf[128], *addr, *type;
		if (gi < 0 || gi >= EMU_MAX_GIDS || strlen(val) >= sizeof(buf))
			return EINVAL;
		snprintf(buf, sizeof(buf), "%s", val);
		addr = strtok(buf, " \t");
		type = strtok(NULL, " \t");
		if (!addr || strtok(NULL, " \t"))
			return EINVAL;
		if (inet_pton(AF_INET6, addr, pc->gids[gi].gid.raw) != 1)
			return EINVAL;
		pc->gids[gi].type = (uint32_t)-1; /* default by link layer later */
		if (type) {
			if (lookup(gid_types, type, &v))
				return EINVAL;
			pc->gids[gi].type = (uint32_t)v;
		}
		pc->gids[gi].valid = 1;
		return 0;
	}
	return ENOENT;
}

static void finish_device(struct emu_device *d, const struct dev_seen *seen)
{
	if (!seen->guid) {
		/* Deterministic and unique per PCI function (or list index). */
		unsigned dom = 0, bus = 0, dev = 0, fn = 0;
		if (d->pci[0])
			sscanf(d->pci, "%x:%x:%x.%x", &dom, &bus, &dev, &fn);
		else
			bus = (unsigned)d->index + 1;
		d->node_guid = 0x0002c90300000000ull | ((uint64_t)dom << 16) |
			       ((uint64_t)bus << 8) | (dev << 3) | fn;
	}
	for (int p = 1; p <= d->port_count; p++) {
		struct emu_port_cfg *pc = &d->ports[p];
		int ib = pc->link_layer == IBV_LINK_LAYER_INFINIBAND;

		if (!seen->lid[p])
			pc->lid = ib ? (uint16_t)(d->index * EMU_MAX_PORTS + p) : 0;
		if (!pc->gids[0].valid) {
			/* link-local GID from the port GUID, like a real HCA */
			pc->gids[0].gid.raw[0] = 0xfe;
			pc->gids[0].gid.raw[1] = 0x80;
			uint64_t g = d->node_guid + (uint64_t)(p - 1);
			for (int i = 0; i < 8; i++)
				pc->gids[0].gid.raw[8 + i] =
					(uint8_t)(g >> (56 - 8 * i));
			pc->gids[0].type = (uint32_t)-1;
			pc->gids[0].valid = 1;
		}
		pc->gid_tbl_len = 0;
		for (int i = 0; i < EMU_MAX_GIDS; i++) {
			if (!pc->gids[i].valid)
				continue;
			if (pc->gids[i].type == (uint32_t)-1)
				pc->gids[i].type = ib ? IBV_GID_TYPE_IB
						      : IBV_GID_TYPE_ROCE_V2;
			pc->gid_tbl_len = i + 1;
		}
	}

	struct ibv_device *ib = &d->ibdev;
	ib->node_type = IBV_NODE_CA;
	ib->transport_type = IBV_TRANSPORT_IB;
	snprintf(ib->dev_name, sizeof(ib->dev_name), "uverbs%d", d->index);
	snprintf(ib->dev_path, sizeof(ib->dev_path), "%s/class/infiniband_verbs/uverbs%d",
		 emu_g.sysfs_root, d->index);
	snprintf(ib->ibdev_path, sizeof(ib->ibdev_path), "%s/class/infiniband/%s",
		 emu_g.sysfs_root, ib->name);
}

/* When a fake sysfs tree is in use, say so if it disagrees with the config. */
static void check_sysfs(const struct emu_device *d)
{
	char link[PATH_MAX + 16], real[PATH_MAX];
	const char *base;

	if (!getenv("FERRY_SYSFS_ROOT") || !d->pci[0])
		return;
	snprintf(link, sizeof(link), "%s/device", d->ibdev.ibdev_path);
	if (!realpath(link, real)) {
		emu_log("note: %s has no %s (fake sysfs tree without this NIC?)",
			d->ibdev.name, link);
		return;
	}
	base = strrchr(real, '/');
	base = base ? base + 1 : real;
	if (strcasecmp(base, d->pci) != 0)
		emu_log("warning: config says %s is at %s, the sysfs tree at %s says %s",
			d->ibdev.name, d->pci, emu_g.sysfs_root, base);
}

static int parse_file(const char *path, struct emu_device *devs, int *ndevs)
{
	struct dev_seen seen[EMU_MAX_DEVICES];
	FILE *f = fopen(path, "re");
	char line[512];
	int lineno = 0, n = 0, err = 0;
	struct emu_device *cur = NULL;

	memset(seen, 0, sizeof(seen));
	if (!f) {
		emu_log("warning: FERRY_VERBS_EMU_CONFIG=%s cannot be read (%s); "
			"no devices",
			path, strerror(errno));
		*ndevs = 0;
		return 0;
	}
	while (fgets(line, sizeof(line), f)) {
		char *s, *eq;

		lineno++;
		if (!strchr(line, '\n') && !feof(f)) {
			emu_log("%s:%d: line too long", path, lineno);
			err = EINVAL;
			break;
		}
		s = trim(line);
		if (!*s || *s == '#' || *s == ';')
			continue;
		if (*s == '[') {
			char *end = strchr(s, ']');
			char *name;
			if (!end || *trim(end + 1)) {
				emu_log("%s:%d: expected [device-name]", path, lineno);
				err = EINVAL;
				break;
			}
			*end = '\0';
			name = trim(s + 1);
			if (!strncmp(name, "device", 6) && isspace((unsigned char)name[6]))
				name = trim(name + 6);
			if (!valid_name(name)) {
				emu_log("%s:%d: bad device name '%s'", path, lineno, name);
				err = EINVAL;
				break;
			}
			for (int i = 0; i < n; i++) {
				if (!strcmp(devs[i].ibdev.name, name)) {
					emu_log("%s:%d: device %s defined twice", path,
						lineno, name);
					err = EINVAL;
				}
			}
			if (err)
				break;
			if (n == EMU_MAX_DEVICES) {
				emu_log("%s:%d: more than %d devices", path, lineno,
					EMU_MAX_DEVICES);
				err = EINVAL;
				break;
			}
			cur = &devs[n];
			default_device(cur, n);
			snprintf(cur->ibdev.name, sizeof(cur->ibdev.name), "%s", name);
			n++;
			continue;
		}
		eq = strchr(s, '=');
		if (!eq || !cur) {
			emu_log("%s:%d: expected 'key = value' inside a [device] section",
				path, lineno);
			err = EINVAL;
			break;
		}
		*eq = '\0';
		char *key = trim(s), *val = trim(eq + 1);
		int r = set_key(cur, &seen[n - 1], key, val);
		if (r == ENOENT) {
			emu_log("%s:%d: unknown key '%s'", path, lineno, key);
			err = EINVAL;
			break;
		}
		if (r) {
			emu_log("%s:%d: bad value '%s' for %s", path, lineno, val, key);
			err = EINVAL;
			break;
		}
	}
	fclose(f);
	if (err)
		return err;
	for (int i = 0; i < n; i++) {
		if (seen[i].max_port_key > devs[i].port_count) {
			emu_log("%s: %s sets port%d.* but has ports = %d", path,
				devs[i].ibdev.name, seen[i].max_port_key,
				devs[i].port_count);
			return EINVAL;
		}
		finish_device(&devs[i], &seen[i]);
		check_sysfs(&devs[i]);
	}
	*ndevs = n;
	return 0;
}

/* FERRY_VERBS_EMU_FAULTS="mlx5_1:port_down_after=20;mlx5_0:wc_error_every=7" */
static int parse_faults(const char *spec, struct emu_device *devs, int ndevs)
{
	char *copy = strdup(spec), *save1 = NULL, *entry;
	int err = 0;

	if (!copy)
		return ENOMEM;
	for (entry = strtok_r(copy, ";", &save1); entry && !err;
	     entry = strtok_r(NULL, ";", &save1)) {
		char *colon, *save2 = NULL, *kv;
		struct emu_fault_cfg f;
		int have[4] = { 0 };

		entry = trim(entry);
		if (!*entry)
			continue;
		if (!strcmp(entry, "no_uverbs")) {
			emu_g.no_uverbs = 1;
			continue;
		}
		colon = strchr(entry, ':');
		if (!colon) {
			emu_log("FERRY_VERBS_EMU_FAULTS: '%s' lacks 'device:'", entry);
			err = EINVAL;
			break;
		}
		*colon = '\0';
		char *dev = trim(entry);
		memset(&f, 0, sizeof(f));
		for (kv = strtok_r(colon + 1, ",", &save2); kv;
		     kv = strtok_r(NULL, ",", &save2)) {
			char *eq = strchr(kv, '=');
			uint64_t u;
			if (!eq) {
				emu_log("FERRY_VERBS_EMU_FAULTS: '%s' is not key=value", kv);
				err = EINVAL;
				break;
			}
			*eq = '\0';
			char *k = trim(kv), *v = trim(eq + 1);
			if (!strcmp(k, "port_down_after") && !parse_u64(v, &u) &&
			    u <= LONG_MAX) {
				f.port_down_after = (long)u;
				have[0] = 1;
			} else if (!strcmp(k, "port") && !parse_u64(v, &u) && u >= 1 &&
				   u <= EMU_MAX_PORTS) {
				f.port_down_port = (int)u;
				have[1] = 1;
			} else if (!strcmp(k, "wc_error_every") && !parse_u64(v, &u) &&
				   u >= 1 && u <= LONG_MAX) {
				f.wc_error_every = (long)u;
				have[2] = 1;
			} else if (!strcmp(k, "wc_error_status") &&
				   !emu_parse_wc_status(v, &f.wc_error_status) &&
				   f.wc_error_status != IBV_WC_SUCCESS) {
				have[3] = 1;
			} else {
				emu_log("FERRY_VERBS_EMU_FAULTS: bad '%s=%s' (keys: "
					"port_down_after=N, port=N, wc_error_every=N, "
					"wc_error_status=NAME)",
					k, v);
				err = EINVAL;
				break;
			}
		}
		if (err)
			break;
		int matched = 0;
		for (int i = 0; i < ndevs; i++) {
			if (strcmp(dev, "*") && strcmp(dev, devs[i].ibdev.name))
				continue;
			matched = 1;
			if (have[0])
				devs[i].fault.port_down_after = f.port_down_after;
			if (have[1])
				devs[i].fault.port_down_port = f.port_down_port;
			if (have[2])
				devs[i].fault.wc_error_every = f.wc_error_every;
			if (have[3])
				devs[i].fault.wc_error_status = f.wc_error_status;
		}
		if (!matched && strcmp(dev, "*"))
			emu_log("note: FERRY_VERBS_EMU_FAULTS names %s, which is not "
				"a configured device",
				dev);
	}
	free(copy);
	return err;
}

int emu_load_config(void)
{
	const char *path = getenv("FERRY_VERBS_EMU_CONFIG");
	const char *faults = getenv("FERRY_VERBS_EMU_FAULTS");
	const char *sysfs = getenv("FERRY_SYSFS_ROOT");
	const char *dir = getenv("FERRY_VERBS_EMU_DIR");
	struct emu_device *devs;
	int n = 0, err;

	if (sysfs && strlen(sysfs) >= sizeof(emu_g.sysfs_root)) {
		emu_log("FERRY_SYSFS_ROOT is longer than %zu bytes",
			sizeof(emu_g.sysfs_root) - 1);
		return EINVAL;
	}
	snprintf(emu_g.sysfs_root, sizeof(emu_g.sysfs_root), "%s",
		 sysfs && *sysfs ? sysfs : "/sys");
	if (dir && *dir) {
		snprintf(emu_g.fabric_dir, sizeof(emu_g.fabric_dir), "%s", dir);
	} else {
		struct stat st;
		const char *base = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode)
					   ? "/dev/shm"
					   : "/tmp";
		snprintf(emu_g.fabric_dir, sizeof(emu_g.fabric_dir),
			 "%s/ferry-verbs-emu-%u", base, (unsigned)getuid());
	}

	devs = calloc(EMU_MAX_DEVICES, sizeof(*devs));
	if (!devs)
		return ENOMEM;
	if (path && *path) {
		err = parse_file(path, devs, &n);
		if (err) {
			free(devs);
			return err;
		}
	}
	if (faults && *faults) {
		err = parse_faults(faults, devs, n);
		if (err) {
			free(devs);
			return err;
		}
	}
	emu_g.devs = devs;
	emu_g.ndevs = n;
	emu_debug("%d device(s) from %s, fabric %s", n, path ? path : "(none)",
		  emu_g.fabric_dir);
	return 0;
}

int emu_init(void)
{
	int err;

	pthread_mutex_lock(&emu_g.init_lock);
	if (!emu_g.initialized) {
		emu_g.init_errno = emu_load_config();
		emu_g.initialized = 1;
	}
	err = emu_g.init_errno;
	pthread_mutex_unlock(&emu_g.init_lock);
	return err;
}
