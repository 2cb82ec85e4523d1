"""The CPU facts every CPU figure is shown with (training.core.machine), read from a made-up /proc/cpuinfo so
that the test passes on any machine; and where the cache root lies."""

import training.core.machine as machine
from training.core.fs import cache_root

CPUINFO = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
    "model name\t: AMD EPYC 7B13\ncpu MHz\t\t: 2445.404\nflags\t\t: fpu sse avx2 fma\n\n"
    "processor\t: 1\nmodel name\t: Another CPU\n"
)


def test_the_cpu_is_described_by_model_clock_and_matmul_flags(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    monkeypatch.setattr(machine, "Path", lambda _: info)
    machine.cpu_flags.cache_clear()
    try:
        assert machine.cpu_model() == "AMD EPYC 7B13 (family 25 model 1)"  # the first processor's
        assert machine.cpu_clock_mhz() == 2445.404
        line = machine.cpu_description()
        assert line.startswith("AMD EPYC 7B13 (family 25 model 1), ") and "2445 MHz" in line
        assert "avx2 fma (no avx512f avx512_bf16 amx_bf16)" in line
    finally:
        machine.cpu_flags.cache_clear()


def test_the_cache_root_follows_llm_forge_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("LLM_FORGE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "llm-forge"
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"
