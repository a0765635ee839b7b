#!/usr/bin/env python3
"""Where the threads of a command that stopped moving are, without a debugger.

Runs COMMAND as a child. If it is still running after --after seconds, stops each of its
threads a few times with ptrace (allowed on the child without CAP_SYS_PTRACE), and
writes per thread its name, state and CPU time, the instruction pointer, and the return
addresses found by scanning its stack (words that point into executable mappings): each
as `FILE+0xOFFSET`, where OFFSET is the address within that ELF file's mapping, as
`addr2line -f -C -e FILE 0xOFFSET` (and `--symbolize` here) reads it. A stack scan also
finds stale addresses; the instruction pointers are exact. Then it kills the command,
unless --keep.

The GPU machine has no gdb; the files named can be symbolized on a machine that has the
same binaries (the release dspec with its debug info, the carried libmlx):
  there: python3 scripts/stall_stacks.py --after 600 --json-out $OUT/stall.json -- /tmp/dspec bench ...
  here:  python3 scripts/stall_stacks.py --symbolize stall.json --map /tmp/dspec=target/release/dspec \
             --map .../libmlx.so=/tmp/libmlx.so

Usage: python3 scripts/stall_stacks.py [--after S] [--samples N] [--json-out F] [--keep] -- COMMAND...
       python3 scripts/stall_stacks.py --symbolize F [--map THERE=HERE ...]
"""

import argparse
import ctypes
import json
import os
import signal
import struct
import subprocess
import sys
import time

PTRACE_GETREGS, PTRACE_DETACH = 12, 17
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
# x86-64 `struct user_regs_struct`: 27 unsigned longs; rip and rsp by index.
REGS_WORDS, RIP, RSP = 27, 16, 19
STACK_BYTES = 32 * 1024
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def executable_mappings(pid):
    """(start, end, path, file offset, start of the file's first mapping) per r-x mapping."""
    maps, first = [], {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5] if len(parts) > 5 else ""
            if path and path not in first:
                first[path] = start
            if "x" in parts[1] and path.startswith("/"):
                maps.append((start, end, path, int(parts[2], 16), first[path]))
    return maps


def place(address, maps):
    for start, end, path, _, base in maps:
        if start <= address < end:
            return f"{path}+{address - base:#x}"
    return None


def thread_facts(pid, tid):
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        name = f.read().strip()
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the name: state is field 3, utime and stime fields 14 and 15 (1-based).
    return name, fields[0], int(fields[11]) + int(fields[12])


def sample_thread(pid, tid, maps, mem):
    """The thread's instruction pointer and its stack scan, or an error string."""
    if libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
        return {"error": f"ptrace seize: {os.strerror(ctypes.get_errno())}"}
    try:
        libc.ptrace(PTRACE_INTERRUPT, tid, None, None)
        os.waitpid(tid, 0x40000000)  # __WALL: a thread, not a child process
        regs = (ctypes.c_ulong * REGS_WORDS)()
        if libc.ptrace(PTRACE_GETREGS, tid, None, ctypes.byref(regs)) != 0:
            return {"error": f"ptrace getregs: {os.strerror(ctypes.get_errno())}"}
        rip, rsp = regs[RIP], regs[RSP]
        try:
            mem.seek(rsp)
            stack = mem.read(STACK_BYTES)
        except OSError:
            stack = b""
        words = struct.unpack(f"<{len(stack) // 8}Q", stack[: len(stack) // 8 * 8])
        found = [p for p in (place(w, maps) for w in words) if p]
        return {"ip": place(rip, maps) or hex(rip), "stack": found[:40]}
    finally:
        libc.ptrace(PTRACE_DETACH, tid, None, None)


def sample(pid, samples):
    maps = executable_mappings(pid)
    threads = {}
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for n in range(samples):
            for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
                try:
                    name, state, ticks = thread_facts(pid, tid)
                except OSError:
                    continue
                entry = threads.setdefault(tid, {"name": name, "samples": []})
                entry.update(state=state, cpu_ticks=ticks)
                entry["samples"].append(sample_thread(pid, tid, maps, mem))
            if n + 1 < samples:
                time.sleep(0.2)
    return threads


def symbolize(path, mapping):
    with open(path) as f:
        record = json.load(f)
    renames = dict(m.split("=", 1) for m in mapping)
    cache, exported = {}, {}

    def nearest_export(file, offset):
        """The exported symbol at or below `offset`: for stripped libraries (the carried
        libmlx keeps only its dynamic symbols), where addr2line has no name."""
        if file not in exported:
            out = subprocess.run(["nm", "-D", "--defined-only", "-C", file],
                                 capture_output=True, text=True)
            table = []
            for line in out.stdout.splitlines():
                parts = line.split(" ", 2)
                if len(parts) == 3 and parts[1].lower() in "tw":
                    table.append((int(parts[0], 16), parts[2]))
            exported[file] = sorted(table)
        below = [entry for entry in exported[file] if entry[0] <= offset]
        return f"{below[-1][1]} + {offset - below[-1][0]:#x}" if below else "?"

    def name(placed):
        if "+" not in placed:
            return placed
        file, offset = placed.rsplit("+", 1)
        local = renames.get(file, file)
        key = (local, offset)
        if key not in cache:
            out = subprocess.run(["addr2line", "-f", "-C", "-e", local, offset],
                                 capture_output=True, text=True)
            fn = out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else "??"
            if fn.startswith("??"):
                fn = nearest_export(local, int(offset, 16))
            cache[key] = f"{fn}  [{os.path.basename(file)}+{offset}]"
        return cache[key]

    for tid, t in record["threads"].items():
        print(f"thread {tid} {t['name']} state {t['state']} cpu {t['cpu_ticks']} ticks")
        for i, s in enumerate(t["samples"]):
            if "error" in s:
                print(f"  sample {i}: {s['error']}")
                continue
            print(f"  sample {i}: ip {name(s['ip'])}")
            if i == 0:
                for p in s["stack"][:25]:
                    print(f"      {name(p)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--after", type=float, default=600.0)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--json-out")
    ap.add_argument("--keep", action="store_true", help="leave the command running")
    ap.add_argument("--symbolize", metavar="JSON")
    ap.add_argument("--map", action="append", default=[], metavar="THERE=HERE")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.symbolize:
        symbolize(args.symbolize, args.map)
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command after --")
    child = subprocess.Popen(command)
    try:
        code = child.wait(timeout=args.after)
        print(f"stall_stacks: the command ended (exit {code}) within {args.after:.0f} s",
              file=sys.stderr)
        if code < 0:
            # Killed by a signal: end the same way, so that the caller sees which.
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        sys.exit(code)
    except subprocess.TimeoutExpired:
        pass
    record = {"command": command, "after_seconds": args.after,
              "threads": sample(child.pid, args.samples)}
    text = json.dumps(record, indent=1)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text)
    else:
        print(text)
    print(f"stall_stacks: {len(record['threads'])} threads sampled after {args.after:.0f} s",
          file=sys.stderr)
    if not args.keep:
        child.send_signal(signal.SIGKILL)
        child.wait()
        sys.exit(124)


if __name__ == "__main__":
    main()
