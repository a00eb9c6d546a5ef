#!/usr/bin/env python3
"""Writes manifest.json of a Ferry artifact (called by packaging/build.sh).

Inputs: the staged prefix, what its own `bin/ferry info --json` said there
(run with a clean environment, so it saw exactly the plugins beside the
library), and check-glibc.sh's per-file table. Output: every plugin with its
kind, name, version and plugin ABI, and every file with its size and sha256
(ELF files also with the highest glibc version they need).

Fails, naming the file, when a shipped plugin was not seen by `ferry info`
(a misnamed file no node would load); warns when one could not be loaded on
the build machine (its version and ABI are then unknown).
"""

import argparse
import hashlib
import json
import os
import sys


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", required=True)
    ap.add_argument("--info", required=True, help="bin/ferry info --json output")
    ap.add_argument("--glibc", required=True, help="check-glibc.sh --tsv output")
    ap.add_argument("--version", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--glibc-floor", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--dirty", action="store_true")
    a = ap.parse_args()

    stage = os.path.abspath(a.stage)
    with open(a.info) as f:
        info = json.load(f)
    glibc = {}
    with open(a.glibc) as f:
        for line in f:
            path, _, version = line.rstrip("\n").partition("\t")
            glibc[os.path.relpath(os.path.abspath(path), stage)] = version

    plugin_dir = os.path.join(stage, "lib", "ferry", "plugins")
    seen = {}
    for p in info.get("plugins", []):
        real = os.path.realpath(p.get("path") or "")
        if os.path.dirname(real) == os.path.realpath(plugin_dir):
            seen[os.path.basename(real)] = p

    errors = []
    plugins = []
    for name in sorted(os.listdir(plugin_dir)):
        rel = os.path.join("lib", "ferry", "plugins", name)
        p = seen.get(name)
        if p is None:
            errors.append(f"{rel}: `ferry info` did not list it (is its name libferry_<kind>_<name>.so?)")
            continue
        entry = {
            "file": rel,
            "kind": p["kind"],
            "name": p["name"],
            "version": p.get("version"),
            "abi": p.get("abi"),
            "description": p.get("description"),
            "glibc": glibc.get(rel),
            "sha256": sha256(os.path.join(stage, rel)),
        }
        if entry["version"] is None or entry["abi"] is None:
            # Its table was never read: the build machine lacks a library it
            # links (libibverbs, say). Shipped all the same; said loudly.
            entry["not_loaded_on_build_host"] = p.get("reason")
            print(
                f"warning: {rel}: version and ABI unknown, it could not be loaded on "
                f"the build machine: {p.get('reason')}",
                file=sys.stderr,
            )
        plugins.append(entry)
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 1

    files = []
    for root, dirs, names in os.walk(stage):
        dirs.sort()
        for n in sorted(names):
            full = os.path.join(root, n)
            if os.path.islink(full):
                continue
            rel = os.path.relpath(full, stage)
            entry = {"path": rel, "size": os.path.getsize(full), "sha256": sha256(full)}
            if rel in glibc:
                entry["glibc"] = glibc[rel]
            files.append(entry)

    manifest = {
        "name": "ferry",
        "version": a.version,
        "target": a.target,
        "glibc_floor": a.glibc_floor,
        "profile": a.profile,
        "plugin_abi": info.get("abi_version"),
        "source": {"commit": a.commit, "dirty": a.dirty},
        "plugins": plugins,
        "files": files,
    }
    json.dump(manifest, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
