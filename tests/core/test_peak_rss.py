"""A child's own peak memory: what bench/memory_modes.py and bench/fsdp_cpu.py read for each mode's and each rank's
process. getrusage's ru_maxrss carries the peak of the process it was exec'd from; VmHWM is the child's own."""
import json
import os
import subprocess
import sys

import pytest

from tier_utils.core.measure import PeakRSS

# A parent that holds 400 MiB, then execs a child that reads both figures.
PARENT = ("import os, sys\n"
          "held = bytearray(400 * 2**20); held[::4096] = b'x' * len(held[::4096])\n"
          "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]])\n")
CHILD = ("import json, resource\n"
         "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
         "print(json.dumps({'maxrss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,"
         " 'own': int(hwm.split()[1]) * 1024}))\n")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc figures")
def test_a_childs_own_peak_is_not_the_peak_it_was_execd_from():
    out = subprocess.run([sys.executable, "-c", PARENT, CHILD], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["maxrss"] >= 400 * 2**20  # the parent's bytearray, carried over exec
    assert figures["own"] < 300 * 2**20  # the child's own: a bare interpreter
    status = open("/proc/self/status").read()  # what PeakRSS.own_peak reads, here
    hwm = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024
    assert hwm <= PeakRSS.own_peak() <= hwm + 64 * 2**20
