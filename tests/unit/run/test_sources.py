"""Model sources: a GGUF file converts once into a cache directory named by the file's contents, so a new
checkout or environment holding the same file (the bundled SmolLM2 in every fresh .venv) reuses it."""

from __future__ import annotations

import os

from training.run import sources


def test_the_same_file_at_two_paths_has_one_key_and_is_hashed_once_per_path(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path / "cache"))
    hashed = []
    real = sources.file_digest
    monkeypatch.setattr(sources, "file_digest", lambda p: hashed.append(p) or real(p))
    a, b = tmp_path / "env1" / "m.gguf", tmp_path / "env2" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    key = sources.content_key(a)
    assert sources.content_key(b) == key and len(key) == 12
    assert sources.content_key(a) == key and sources.content_key(b) == key
    assert hashed == [a, b]  # the second look at each path reads the index
    assert (tmp_path / "cache" / "models" / "digests.json").is_file()


def test_a_changed_file_gets_a_new_key(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF one")
    before = sources.content_key(f)
    f.write_bytes(b"GGUF two")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert sources.content_key(f) != before


def test_a_torn_index_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "digests.json").write_text('{"trunc')
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert sources.content_key(f) == sources.file_digest(f)[:12]


def test_converting_draws_nothing_from_the_runs_random_generator(tmp_path, monkeypatch):
    """Converting builds a model whose random init is then overwritten: a run that converts the bundled model
    (a fresh cache) must start its adapters from the weights of a run that finds it converted (it did not:
    demo's step 3 moved by 5e-4)."""
    import torch

    monkeypatch.setenv("LLM_FORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "_convert", lambda path, out: torch.rand(1000))  # an init that draws
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    torch.manual_seed(3)
    sources.convert_gguf(f)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))
