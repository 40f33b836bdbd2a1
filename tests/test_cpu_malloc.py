"""The CPU allocator policy: parsed as documented, applied by one restart of the program when asked (never
by default), inherited by spawned ranks, and doing what it says to the page faults of a big buffer
allocated twice and to the heap of a loop of buffers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ditsp.cpu import malloc as cpu_malloc
from ditsp.cpu import settings as cpu_settings

RESTART = cpu_settings.ENV["malloc_restart"]
GLIBC = cpu_malloc.glibc_version() is not None
needs_glibc = pytest.mark.skipif(not GLIBC, reason="GLIBC_TUNABLES is glibc's")


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", cpu_malloc.ENV, cpu_malloc.APPLIED, RESTART)}
    env.update(extra)
    return env


def test_policy_default_case_and_unknown():
    assert cpu_malloc.policy({}) == cpu_malloc.DEFAULT == "reuse"
    assert cpu_malloc.policy({cpu_malloc.ENV: " System "}) == "system"
    with pytest.raises(ValueError, match=r"DITSP_CPU_MALLOC='huge': expected one of reuse, hugepages, system"):
        cpu_malloc.policy({cpu_malloc.ENV: "huge"})


@needs_glibc
def test_rank_environment_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "glibc_version", lambda: (2, 36))
    huge = {cpu_malloc.ENV: "hugepages"}
    reuse = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1073741824:"
             "glibc.malloc.trim_threshold=4611686018427387904:glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0")
    assert cpu_malloc.rank_environment({cpu_malloc.ENV: "system"}) == {}
    assert cpu_malloc.rank_environment(huge) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert cpu_malloc.rank_environment({}) == {"GLIBC_TUNABLES": reuse}
    # another tunable stays and the policy's is added after it; a value the user gave the same key wins
    assert cpu_malloc.rank_environment({**huge, "GLIBC_TUNABLES": "glibc.rtld.x=1"}) == {
        "GLIBC_TUNABLES": "glibc.rtld.x=1:glibc.malloc.hugetlb=1"}
    assert cpu_malloc.rank_environment({**huge, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}
    assert cpu_malloc.rank_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.tcache_count=7:" + reuse.replace(":glibc.malloc.tcache_count=0", "")}
    assert not cpu_malloc.in_effect({})
    assert cpu_malloc.in_effect({"GLIBC_TUNABLES": reuse})
    assert cpu_malloc.in_effect({**huge, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    monkeypatch.setattr(cpu_malloc, "glibc_version", lambda: (2, 34))  # hugetlb came with 2.35
    assert cpu_malloc.rank_environment(huge) == {}
    assert "no effect here (glibc older than 2.35)" in cpu_malloc.describe(huge)
    assert cpu_malloc.rank_environment({}) == {"GLIBC_TUNABLES": reuse.replace("glibc.malloc.hugetlb=1:", "")}
    monkeypatch.setattr(cpu_malloc, "glibc_version", lambda: (2, 30))  # mxfast, the last of them, came with 2.31
    assert cpu_malloc.rank_environment({}) == {}
    assert "no effect here (glibc older than 2.31)" in cpu_malloc.describe({})


def test_no_glibc_means_nothing_to_set(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "glibc_version", lambda: None)
    assert cpu_malloc.rank_environment({}) == {}
    assert cpu_malloc.in_effect({})
    assert "no effect here (no glibc)" in cpu_malloc.describe({})


@needs_glibc
def test_reexec_restarts_once_with_the_tunables():
    code = ("import os, sys; from ditsp.cpu import malloc as cpu_malloc; print('start', flush=True); cpu_malloc.reexec(); "
            "print(os.environ.get('GLIBC_TUNABLES'), os.environ.get(cpu_malloc.APPLIED), sys.argv[1:])")
    out = subprocess.run([sys.executable, "-c", code, "a b", "c"], env=_env(), capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")
    entries = ":".join(cpu_malloc.tunables(cpu_malloc.DEFAULT))
    if entries:  # started twice, then the arguments as given
        assert out[:3] == ["start", "start", f"{entries} 1 ['a b', 'c']"]
    else:  # glibc older than 2.31: the policy needs nothing, nothing restarts
        assert out[:2] == ["start", "None None ['a b', 'c']"]


def test_the_program_rejects_an_unknown_policy_in_one_line():
    r = subprocess.run([sys.executable, "-m", "ditsp.cli", "doctor"], env=_env(**{cpu_malloc.ENV: "fast"}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == "ditsp: DITSP_CPU_MALLOC='fast': expected one of reuse, hugepages, system\n"


# The `ditsp` program with its command replaced by a print of whether this process is a restart.
_PROGRAM = ("import os; print('start', flush=True); from ditsp import cli; "
            "cli.main = lambda argv=None: print(os.environ.get('DITSP_CPU_MALLOC_APPLIED')) or 0; cli.run()")


def _program(**env) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _PROGRAM, "x"], env=_env(**env), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_the_program_runs_as_started_unless_the_restart_is_asked_for():
    assert _program() == ["start", "None"]  # the default: no restart, whatever the policy needs
    assert _program(**{RESTART: "0"}) == ["start", "None"]
    if cpu_malloc.tunables(cpu_malloc.DEFAULT):
        assert _program(**{RESTART: "1"}) == ["start", "start", "1"]  # started again once, under the policy
    assert _program(**{RESTART: "1", cpu_malloc.ENV: "system"}) == ["start", "None"]  # nothing to apply
    r = subprocess.run([sys.executable, "-c", _PROGRAM], env=_env(**{RESTART: "yes"}), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == "ditsp: DITSP_CPU_MALLOC_RESTART='yes': expected one of 1, 0\n"


def _tunables_of_rank(ctx):
    return os.environ.get("GLIBC_TUNABLES")


@needs_glibc
def test_spawned_ranks_start_under_the_policy(clusters, monkeypatch):
    monkeypatch.delenv(cpu_malloc.ENV, raising=False)
    expected = cpu_malloc.rank_environment().get("GLIBC_TUNABLES", os.environ.get("GLIBC_TUNABLES"))
    before = dict(os.environ)
    assert clusters(2).run(_tunables_of_rank) == [expected, expected]
    assert dict(os.environ) == before  # the parent's own environment is left as it was


_FAULTS = """
import json, resource, torch
def faults(n):
    x = torch.empty(n, dtype=torch.uint8); x.fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del x
    y = torch.empty(n, dtype=torch.uint8); y.fill_(2)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults(64 << 20)
print(json.dumps(faults(64 << 20)))
"""


def _second_buffer_faults(policy: str) -> int:
    env = _env(**{cpu_malloc.ENV: policy})
    env.update(cpu_malloc.rank_environment(env))
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout)


@needs_glibc
def test_hugepages_cut_the_faults_of_a_big_buffer():
    if not cpu_malloc.tunables("hugepages") or cpu_malloc.transparent_hugepages() not in ("always", "madvise"):
        pytest.skip("glibc older than 2.35 or transparent huge pages off: the policy changes nothing here")
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    if cpu_malloc.transparent_hugepages() == "madvise":  # ("always" gives huge pages to every big mapping)
        assert _second_buffer_faults("system") > 0.9 * pages  # a 64 MiB block mapped afresh: every page faults
    assert _second_buffer_faults("hugepages") < 0.25 * pages  # one fault per 2 MiB where huge pages are free


_LOOP = """
import json, resource, torch
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
shapes = [(17, 64, 128, 64), (17, 64, 128, 48), (9, 64, 128, 64)]  # 34, 25.5 and 18 MiB in fp32
kept, written = [], 0
for i in range(40):
    a, b = torch.ones(shapes[i % 3]), torch.ones(shapes[(i + 1) % 3])
    small = [torch.ones(100 + j) for j in range(50)]  # small blocks between the big ones, a few kept
    kept.append(small[::10])
    if i == 9:
        f0, r0, written = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, rss(), 0
    written += a.nbytes + b.nbytes
    del a, b, small
f1, r1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, rss()
print(json.dumps({"faults": f1 - f0, "pages": written // 4096, "grew": r1 - r0, "biggest": 17 * 64 * 128 * 64 * 4}))
"""


@needs_glibc
def test_reuse_serves_a_loop_of_buffers_from_the_same_pages():
    """The job's pattern: windows of the same big buffers with small ones in between. Under ``reuse``,
    after a warm-up, 30 rounds (about 1.6 GB written) take no new pages and the heap does not grow.
    (Measured here, glibc 2.36: ``hugepages`` took 10,757 faults; the heap settings without the cache
    and fast-bin entries grew the heap by 365 MB, ten of the biggest buffer.)"""
    if not cpu_malloc.tunables("reuse"):
        pytest.skip("glibc older than 2.31: the policy changes nothing here")
    env = _env(**{cpu_malloc.ENV: "reuse"})
    env.update(cpu_malloc.rank_environment(env))
    out = subprocess.run([sys.executable, "-c", _LOOP], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    r = json.loads(out.stdout)
    assert r["faults"] < 0.01 * r["pages"], r
    assert r["grew"] < r["biggest"], r


def test_release_free_heap_is_safe_anywhere(monkeypatch):
    cpu_malloc.release_free_heap()  # glibc: malloc_trim; this process goes on
    monkeypatch.setattr(cpu_malloc, "glibc_version", lambda: None)
    cpu_malloc.release_free_heap()  # no glibc: nothing to call


def test_reexec_runs_on_when_the_program_cannot_start_again(monkeypatch):
    calls = []

    def refuse(*args):
        calls.append(args)
        raise PermissionError("no exec here")

    monkeypatch.setattr(cpu_malloc, "rank_environment", lambda environ=None: {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    monkeypatch.delenv(cpu_malloc.APPLIED, raising=False)
    monkeypatch.setattr(os, "execve", refuse)
    cpu_malloc.reexec()  # returns: this process goes on as it started
    assert len(calls) == 1
    monkeypatch.setenv(cpu_malloc.APPLIED, "1")
    cpu_malloc.reexec()  # applied once already: never a second restart
    assert len(calls) == 1
