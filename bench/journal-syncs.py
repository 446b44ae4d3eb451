#!/usr/bin/env python3
"""Would the audit journal's durable tail shrink if syncs overlapped?

Simulates the journal on this disk, without canarygate: records arrive at
random (Poisson) at RATE per second; a writer appends whatever has queued
to one zero-filled (preallocated) file and hands it to a sync thread. With
depth 1 the next batch waits for the sync under way (the journal as it is);
with depth N up to N `fdatasync`s run at once, each thread on its own file
descriptor, and records are answered in order. A second thread can stand
in for the index writer: a 64 KiB write and two fsyncs of another file
every 50 ms (`--index-writer`). Prints, per depth, the wait of each record
from arrival to answer.

    python3 bench/journal-syncs.py DIR [--rate 3000] [--seconds 8]
        [--depths 1,2,3] [--rounds 2] [--index-writer]

DIR must be on the disk under test (the data directory's filesystem).
"""
import argparse
import collections
import os
import queue
import random
import threading
import time


def index_writer(directory, stop):
    path = os.path.join(directory, "index-standin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    block = os.urandom(64 << 10)
    n = 0
    while not stop.is_set():
        os.pwrite(fd, block, (n % 256) * len(block))
        os.fsync(fd)
        os.pwrite(fd, block[:4096], 0)
        os.fsync(fd)
        n += 1
        time.sleep(0.05)
    os.close(fd)
    os.unlink(path)


def run(directory, rate, seconds, depth):
    path = os.path.join(directory, "journal-standin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"\0" * (64 << 20))
    os.fsync(fd)
    os.lseek(fd, 0, os.SEEK_SET)
    sync_fds = [os.open(path, os.O_RDWR) for _ in range(depth)]
    record = os.urandom(1500)
    arrivals = queue.Queue()
    waits = []
    lock = threading.Lock()
    in_flight = collections.deque()  # [arrival times, synced?], oldest first
    slots = threading.Semaphore(depth)
    to_sync = queue.Queue()

    def arrive():
        due = time.perf_counter()
        end = due + seconds
        while due < end:
            due += random.expovariate(rate)
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            arrivals.put(time.perf_counter())
        arrivals.put(None)

    def sync(fd_of_thread):
        while (batch := to_sync.get()) is not None:
            os.fdatasync(fd_of_thread)
            with lock:
                batch[1] = True
                while in_flight and in_flight[0][1]:
                    done = in_flight.popleft()
                    now = time.perf_counter()
                    waits.extend(now - at for at in done[0])
                    slots.release()

    syncers = [threading.Thread(target=sync, args=(f,)) for f in sync_fds]
    for thread in syncers:
        thread.start()
    source = threading.Thread(target=arrive)
    source.start()
    syncs = 0
    ended = False
    while not ended:
        first = arrivals.get()
        if first is None:
            break
        slots.acquire()
        batch = [first]
        while True:
            try:
                more = arrivals.get_nowait()
            except queue.Empty:
                break
            if more is None:
                ended = True
                break
            batch.append(more)
        os.write(fd, record * len(batch))
        entry = [batch, False]
        with lock:
            in_flight.append(entry)
        to_sync.put(entry)
        syncs += 1
    for _ in syncers:
        to_sync.put(None)
    for thread in syncers:
        thread.join()
    source.join()
    for f in sync_fds + [fd]:
        os.close(f)
    os.unlink(path)
    waits.sort()
    n = len(waits)

    def at(q):
        return waits[min(n - 1, int(n * q))] * 1e6

    print(
        f"depth {depth}: {n} records, {syncs} syncs, wait p50 {at(0.5):.0f} "
        f"p90 {at(0.9):.0f} p99 {at(0.99):.0f} p99.9 {at(0.999):.0f} µs",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--rate", type=float, default=3000)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--depths", default="1,2,3")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--index-writer", action="store_true")
    args = parser.parse_args()
    stop = threading.Event()
    if args.index_writer:
        threading.Thread(target=index_writer, args=(args.directory, stop), daemon=True).start()
    try:
        for round_ in range(1, args.rounds + 1):
            print(f"round {round_}: {args.rate:.0f} records/s", flush=True)
            for depth in (int(d) for d in args.depths.split(",")):
                run(args.directory, args.rate, args.seconds, depth)
    finally:
        stop.set()


if __name__ == "__main__":
    main()
