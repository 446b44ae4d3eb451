#!/usr/bin/env python3
"""Would the audit journal's record be cheaper made durable another way?

The journal writes each batch of records into a preallocated, zero-filled
segment and calls `fdatasync`. This times, without canarygate, one record
of SIZE bytes at a time made durable four ways in a preallocated file on
this disk, and prints per mode the latency of each write (p50, p99), the
writes per second, this process's CPU and the machine's (from /proc/stat,
so kernel threads writing pages back count) per write:

- `fdatasync`: `pwrite` then `fdatasync` (the journal as it is);
- `o_dsync`: `pwrite` on a descriptor opened with `O_DSYNC`;
- `rwf_dsync`: `pwritev2` with `RWF_DSYNC`, on a plain descriptor;
- `o_direct`: `O_DIRECT | O_DSYNC`, each write the 4 KiB blocks from the
  one holding the record's start (a partly filled block is written again,
  as a log with direct I/O has to).

    python3 bench/sync-modes.py DIR [--writes 20000] [--size 900] [--rounds 3]

DIR must be on the disk under test (the data directory's filesystem).
"""
import argparse
import mmap
import os
import resource
import time

SEGMENT = 64 << 20
BLOCK = 4096


def preallocate(path):
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    zeros = bytes(1 << 20)
    for _ in range(SEGMENT >> 20):
        os.write(fd, zeros)
    os.fsync(fd)
    os.close(fd)


def machine_busy_seconds():
    with open("/proc/stat") as stat:
        jiffies = [int(field) for field in stat.readline().split()[1:]]
    idle = jiffies[3] + jiffies[4]
    return (sum(jiffies) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(path, mode, writes, record):
    preallocate(path)
    flags = os.O_WRONLY
    if mode == "o_dsync":
        flags |= os.O_DSYNC
    elif mode == "o_direct":
        flags |= os.O_DIRECT | os.O_DSYNC
    fd = os.open(path, flags)
    # O_DIRECT wants an aligned buffer: an anonymous map is page-aligned.
    blocks = mmap.mmap(-1, 1 << 20)
    offset = 0
    latencies = []
    cpu0, busy0, wall0 = process_cpu_seconds(), machine_busy_seconds(), time.perf_counter()
    for _ in range(writes):
        start = time.perf_counter()
        if mode == "fdatasync":
            os.pwrite(fd, record, offset)
            os.fdatasync(fd)
        elif mode == "o_dsync":
            os.pwrite(fd, record, offset)
        elif mode == "rwf_dsync":
            os.pwritev(fd, [record], offset, os.RWF_DSYNC)
        else:
            first_block = offset - offset % BLOCK
            end = offset + len(record)
            padded_end = -(-end // BLOCK) * BLOCK
            blocks[offset - first_block : end - first_block] = record
            os.pwritev(fd, [memoryview(blocks)[: padded_end - first_block]], first_block)
            # The block the next record starts in moves to the buffer's front.
            last_block = end - end % BLOCK
            if last_block != first_block:
                tail = blocks[last_block - first_block : padded_end - first_block]
                blocks[: len(tail)] = tail
        offset += len(record)
        latencies.append(time.perf_counter() - start)
    wall = time.perf_counter() - wall0
    cpu = process_cpu_seconds() - cpu0
    busy = machine_busy_seconds() - busy0
    os.close(fd)
    latencies.sort()
    print(
        f"{mode:10} p50 {latencies[writes // 2] * 1e6:6.0f} µs  "
        f"p99 {latencies[int(writes * 0.99)] * 1e6:6.0f} µs  "
        f"{writes / wall:6.0f} writes/s  "
        f"CPU per write: process {cpu / writes * 1e6:5.1f} µs, machine {busy / writes * 1e6:5.1f} µs",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--writes", type=int, default=20000)
    parser.add_argument("--size", type=int, default=900, help="bytes per record")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.writes * args.size > SEGMENT:
        parser.error("writes × size must fit the 64 MiB file")
    path = os.path.join(args.dir, "sync-modes.tmp")
    record = os.urandom(args.size)
    try:
        for _ in range(args.rounds):
            for mode in ("fdatasync", "o_dsync", "rwf_dsync", "o_direct"):
                run(path, mode, args.writes, record)
    finally:
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
