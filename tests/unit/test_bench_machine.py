"""unidist.bench.machine: what every benchmark records about the machine it ran on (no launcher)."""

from __future__ import annotations

from pathlib import Path

from unidist.bench.machine import line, machine, thp_mode


def test_machine_keys_and_types() -> None:
    m = machine(copy_bytes=16 << 20)
    assert isinstance(m["cpu_model"], str) and m["cpu_model"]
    assert isinstance(m["cpus"], int) and m["cpus"] >= 1
    assert isinstance(m["cpus_usable"], int) and 1 <= m["cpus_usable"] <= m["cpus"]
    assert m["memory_GiB"] is None or m["memory_GiB"] > 0
    assert isinstance(m["thp"], str) and isinstance(m["kernel"], str)
    assert isinstance(m["copy_GBps"], float) and m["copy_GBps"] > 0.01  # any machine copies 10 MB/s
    assert m["copy_bytes"] <= 16 << 20 and m["copy_copies"] >= 2
    assert m["copy_huge_share"] is None or 0 <= m["copy_huge_share"] <= 1
    assert m["versions"]["python"] and "torch" in m["versions"]
    text = line(m)
    assert text.startswith("machine: ") and "GB/s" in text and "\n" not in text


def test_machine_without_bandwidth_says_so() -> None:
    m = machine(bandwidth=False)
    assert m["copy_GBps"] is None
    assert "copy bandwidth not measured" in line(m)


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise"
    assert thp_mode(tmp_path / "missing") == "absent"
