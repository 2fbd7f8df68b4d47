"""swarm.host.malloc: freed activations are reused without the kernel faulting their pages in again."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import resource, sys, torch
from swarm.host import malloc
malloc.tune()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(64 << 20).fill_(1.0)  # 256 MiB, freed at once: room for what follows
before = faults()
torch.empty(16 << 20).fill_(2.0)
print(faults() - before)
"""


def faults_of_second_block(env_extra: dict) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_a_freed_block_is_reused_without_page_faults():
    assert faults_of_second_block({}) < 1000  # 64 MiB is 16384 pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_the_users_malloc_settings_have_the_last_word():
    assert faults_of_second_block({"MALLOC_ARENA_MAX": "2"}) > 10000
