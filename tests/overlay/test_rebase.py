# SPDX-License-Identifier: Apache-2.0
"""`build.py rebase`: real upstream releases (cached like the pinned wheel) and
synthetic releases served from a local file:// index for the conflict cases."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.overlay.test_build import make_wheel, run_build, sha256, synthetic_lock

ROOT = Path(__file__).resolve().parents[2]


def copy_project(dest: Path) -> Path:
    dest.mkdir()
    for name in ("build.py", "upstream.lock"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("tools", "vllm_overlay"):
        shutil.copytree(ROOT / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def overlay_snapshot(proj: Path) -> dict[str, bytes]:
    return {p.relative_to(proj).as_posix(): p.read_bytes()
            for p in sorted((proj / "vllm_overlay").rglob("*.py"))}


def run_build_env(proj, env, *args):
    return subprocess.run([sys.executable, "build.py", *args], cwd=proj, env=env,
                          capture_output=True, text=True)


# --------------------------------------------------------------------------------------
# Real releases
# --------------------------------------------------------------------------------------
INDEXER = "vllm/model_executor/layers/sparse_attn_indexer.py"
MERGED = {"clean", "upstream-unchanged", "new", "other-upstream"}


def drop_overlay_file(proj: Path, rel: str) -> None:
    """Remove one replaced file from a project copy (file and lock entry)."""
    (proj / "vllm_overlay" / rel).unlink()
    lock = (proj / "upstream.lock").read_text()
    start = lock.index(f'[overlay."{rel}"]')
    end = lock.find("\n[", start + 1)
    (proj / "upstream.lock").write_text(lock[:start] + (lock[end + 1:] if end > 0 else ""))


def test_0_25_0_conflicts_in_the_indexer_and_abort_restores(tmp_path):
    """0.26.0 -> 0.25.0 with the real overlay: 0.26.0 reworked the sparse indexer op our
    hunks extend (DCP merge, empty local chunks), so that file conflicts and every other
    vLLM file merges; the plugin's files are another upstream's and stay as they are. The
    rebase stops with markers and --abort restores the overlay and the lock byte for
    byte."""
    proj = copy_project(tmp_path / "proj")
    lock0, files0 = (proj / "upstream.lock").read_text(), overlay_snapshot(proj)
    res = run_build("rebase", "--to", "0.25.0", "--report", str(tmp_path / "r.json"), cwd=proj)
    assert res.returncode == 7, res.stdout + res.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    results = {f["path"]: f["result"] for f in report["files"]}
    assert results.pop(INDEXER) == "conflict"
    assert set(results.values()) <= MERGED, results
    assert {r for r, v in results.items() if v == "other-upstream"} == {
        r for r in results if r.startswith("vllm_gguf_plugin/")}
    assert not report["lock_updated"]
    assert "<<<<<<<" in (proj / "vllm_overlay" / INDEXER).read_text()
    assert (proj / "upstream.lock").read_text() == lock0
    assert set(reported_fates(res.stdout)) == set(tomllib.loads(lock0)["overlay"])
    # The report names what the backend relies on that changed upstream.
    backend = next(f for f in report["files"] if f["path"].endswith("triton_mla_sparse.py"))
    assert backend["imports_changed_upstream"]
    back = run_build("rebase", "--abort", cwd=proj)
    assert back.returncode == 0, back.stdout + back.stderr
    assert (proj / "upstream.lock").read_text() == lock0
    assert overlay_snapshot(proj) == files0


def test_round_trip_0_25_0(tmp_path):
    """Without the conflicting file, 0.26.0 -> 0.25.0 merges cleanly and moves the vLLM
    pin (the plugin's stays); back to 0.26.0 restores the overlay and the lock byte for
    byte."""
    proj = copy_project(tmp_path / "proj")
    drop_overlay_file(proj, INDEXER)
    assert run_build("check", cwd=proj).returncode == 0
    lock0, files0 = (proj / "upstream.lock").read_text(), overlay_snapshot(proj)
    res = run_build("rebase", "--to", "0.25.0", "--report", str(tmp_path / "r.json"), cwd=proj)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["clean"] and report["lock_updated"]
    results = {f["path"]: f["result"] for f in report["files"]}
    assert results["vllm/platforms/cuda.py"] in ("clean", "upstream-unchanged")
    assert results["vllm/v1/attention/backends/mla/triton_mla_sparse.py"] == "new"
    lock = tomllib.loads((proj / "upstream.lock").read_text())
    assert lock["upstream"]["version"] == "0.25.0"
    assert lock["plugin"] == tomllib.loads(lock0)["plugin"]
    assert lock["upstream"]["sdist"]["filename"] == "vllm-0.25.0.tar.gz"
    assert lock["upstream"]["wheels"]["manylinux_2_28_x86_64"]["sha256"] == report["wheel"]["sha256"]
    cuda = (proj / "vllm_overlay/vllm/platforms/cuda.py").read_text()
    assert cuda.count("AttentionBackendEnum.TRITON_MLA_SPARSE,") == 3
    check = run_build("check", cwd=proj)
    assert check.returncode == 0, check.stderr
    back = run_build("rebase", "--to", "0.26.0", cwd=proj)
    assert back.returncode == 0, back.stdout + back.stderr
    assert (proj / "upstream.lock").read_text() == lock0
    assert overlay_snapshot(proj) == files0


# --------------------------------------------------------------------------------------
# Synthetic releases on a local index
# --------------------------------------------------------------------------------------
BASE = "a = 1\nb = 2\nc = 3\nd = 4\n"
OURS = "a = 1\n# overlay: b matters\nb = 20\nc = 3\nd = 4\n"


def synthetic(tmp_path, new_files: dict[str, str]):
    """Project pinned to synthetic 0.23.0 with vllm/mod.py replaced; index with 0.23.1,
    and vllm-gguf-plugin 0.0.3 (not pinned)."""
    plugin_index = tmp_path / "index" / "vllm-gguf-plugin"
    plugin_index.mkdir(parents=True)
    plugin_wheel = plugin_index / "vllm_gguf_plugin-0.0.3-cp310-abi3-manylinux_2_28_x86_64.whl"
    make_wheel(plugin_wheel, "0.0.3", {"vllm_gguf_plugin/__init__.py": "",
                                       "vllm_gguf_plugin/mod.py": BASE},
               name="vllm-gguf-plugin")
    (plugin_index / "vllm_gguf_plugin-0.0.3.tar.gz").write_bytes(b"plugin sdist")
    (plugin_index / "index.json").write_text(json.dumps({"files": [
        {"filename": p.name, "url": p.name, "hashes": {"sha256": sha256(p)}}
        for p in sorted(plugin_index.iterdir()) if p.suffix != ".json"]}))
    index = tmp_path / "index" / "vllm"
    index.mkdir(parents=True)
    common = {"vllm/__init__.py": "", "vllm/_version.py":
              "__version__ = version = 'x'\n__version_tuple__ = version_tuple = (0,)\n"}
    listing = []
    for version, files in (("0.23.0", {**common, "vllm/mod.py": BASE}),
                           ("0.23.1", {**common, **new_files})):
        name = f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
        make_wheel(index / name, version, files)
        sdist = index / f"vllm-{version}.tar.gz"
        sdist.write_bytes(f"sdist {version}".encode())
        listing += [{"filename": p.name, "url": p.name, "hashes": {"sha256": sha256(p)}}
                    for p in (index / name, sdist)]
    (index / "index.json").write_text(json.dumps({"files": listing}))
    proj = tmp_path / "proj"
    (proj / "vllm_overlay/vllm").mkdir(parents=True)
    shutil.copy(ROOT / "build.py", proj)
    shutil.copytree(ROOT / "tools", proj / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    (proj / "vllm_overlay/vllm/mod.py").write_text(OURS)
    (proj / "vllm_overlay/vllm/extra.py").write_text("x = 1\n")
    sha = {f["filename"]: f["hashes"]["sha256"] for f in listing}
    (proj / "upstream.lock").write_text(synthetic_lock(
        sha["vllm-0.23.0.tar.gz"], sha["vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"],
        f'''[requires]
[overlay."vllm/extra.py"]
new = true
[overlay."vllm/mod.py"]
base_sha256 = "{hashlib.sha256(BASE.encode()).hexdigest()}"'''))
    env = dict(os.environ, PIP_INDEX_URL=(tmp_path / "index").as_uri(),
               VLLM_OVERLAY_CACHE=str(tmp_path / "cache"))
    return proj, env


def rebase(proj, env, *args):
    return subprocess.run([sys.executable, "build.py", "rebase", *args], cwd=proj, env=env,
                          capture_output=True, text=True)


def test_synthetic_clean_merge(tmp_path):
    proj, env = synthetic(tmp_path, {"vllm/mod.py": BASE.replace("d = 4", "d = 40")})
    res = rebase(proj, env, "--to", "0.23.1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (proj / "vllm_overlay/vllm/mod.py").read_text() == OURS.replace("d = 4", "d = 40")
    lock = tomllib.loads((proj / "upstream.lock").read_text())
    assert lock["upstream"]["version"] == "0.23.1"
    assert lock["overlay"]["vllm/mod.py"]["base_sha256"] == hashlib.sha256(
        BASE.replace("d = 4", "d = 40").encode()).hexdigest()
    assert subprocess.run([sys.executable, "build.py", "check"], cwd=proj, env=env,
                          capture_output=True).returncode == 0


def test_synthetic_conflict(tmp_path):
    proj, env = synthetic(tmp_path, {"vllm/mod.py": BASE.replace("b = 2", "b = 3")})
    lock0 = (proj / "upstream.lock").read_text()
    dry = rebase(proj, env, "--check", "0.23.1")
    assert dry.returncode == 7 and "conflict" in dry.stdout
    assert (proj / "vllm_overlay/vllm/mod.py").read_text() == OURS
    res = rebase(proj, env, "--to", "0.23.1", "--report", str(tmp_path / "r.json"))
    assert res.returncode == 7
    merged = (proj / "vllm_overlay/vllm/mod.py").read_text()
    assert "<<<<<<< overlay" in merged and ">>>>>>> upstream 0.23.1" in merged
    assert (proj / "upstream.lock").read_text() == lock0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["files"][1]["result"] == "conflict" and report["files"][1]["conflicts"] == 1
    check = subprocess.run([sys.executable, "build.py", "check"], cwd=proj, env=env,
                           capture_output=True, text=True)
    assert check.returncode == 5 and "unresolved merge conflict markers" in check.stderr
    again = rebase(proj, env, "--to", "0.23.1")
    assert again.returncode == 7 and "a rebase is in progress" in again.stderr
    early = rebase(proj, env, "--continue")
    assert early.returncode == 7 and "unresolved conflict markers in: vllm/mod.py" in early.stderr
    # The maintainer resolves the conflict, then --continue moves the pin.
    (proj / "vllm_overlay/vllm/mod.py").write_text(
        "a = 1\n# overlay: b matters\nb = 30\nc = 3\nd = 4\n")
    res = rebase(proj, env, "--continue")
    assert res.returncode == 0, res.stdout + res.stderr
    lock = tomllib.loads((proj / "upstream.lock").read_text())
    assert lock["upstream"]["version"] == "0.23.1"
    assert lock["overlay"]["vllm/mod.py"]["base_sha256"] == hashlib.sha256(
        BASE.replace("b = 2", "b = 3").encode()).hexdigest()
    assert not (proj / "rebase-pending.json").exists()
    check = subprocess.run([sys.executable, "build.py", "check"], cwd=proj, env=env,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_synthetic_conflict_abort(tmp_path):
    proj, env = synthetic(tmp_path, {"vllm/mod.py": BASE.replace("b = 2", "b = 3")})
    lock0, files0 = (proj / "upstream.lock").read_text(), overlay_snapshot(proj)
    assert rebase(proj, env, "--to", "0.23.1").returncode == 7
    assert overlay_snapshot(proj) != files0
    res = rebase(proj, env, "--abort")
    assert res.returncode == 0, res.stderr
    assert overlay_snapshot(proj) == files0 and (proj / "upstream.lock").read_text() == lock0
    assert not (proj / "rebase-pending.json").exists()


def test_synthetic_allow_conflicts_moves_pin(tmp_path):
    proj, env = synthetic(tmp_path, {"vllm/mod.py": BASE.replace("b = 2", "b = 3")})
    res = rebase(proj, env, "--to", "0.23.1", "--allow-conflicts")
    assert res.returncode == 7
    assert tomllib.loads((proj / "upstream.lock").read_text())["upstream"]["version"] == "0.23.1"
    assert "<<<<<<< overlay" in (proj / "vllm_overlay/vllm/mod.py").read_text()
    assert not (proj / "rebase-pending.json").exists()


def test_synthetic_added_upstream_stops(tmp_path):
    """A new overlay file at a path the release now has: nothing is written."""
    proj, env = synthetic(tmp_path, {"vllm/mod.py": BASE, "vllm/extra.py": "y = 2\n"})
    lock0, files0 = (proj / "upstream.lock").read_text(), overlay_snapshot(proj)
    res = rebase(proj, env, "--to", "0.23.1", "--report", str(tmp_path / "r.json"))
    assert res.returncode == 7 and "added-upstream" in res.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert "added-upstream" in {f["result"] for f in report["files"]}
    assert not (proj / "rebase-pending.json").exists()
    assert (proj / "upstream.lock").read_text() == lock0
    assert overlay_snapshot(proj) == files0


def test_synthetic_deleted_upstream_waits_for_the_move(tmp_path):
    """The release deleted the file vllm/mod.py replaces (its code moved to
    vllm/renamed/mod.py): the rebase waits, as for conflicts, until the maintainer has
    moved the change to where it lives now and removed the old overlay file; then
    --continue moves the pin and drops the old file's lock entry, and `check` names the
    entry the new file needs (its base: the new release's file)."""
    proj, env = synthetic(tmp_path, {"vllm/renamed/mod.py": BASE})
    lock0 = (proj / "upstream.lock").read_text()
    res = rebase(proj, env, "--to", "0.23.1", "--report", str(tmp_path / "r.json"))
    assert res.returncode == 7, res.stdout + res.stderr
    assert "deleted-upstream     vllm/mod.py" in res.stdout
    assert "new upstream files of the same name: vllm/renamed/mod.py" in res.stdout
    assert "move each change to where its mechanism lives now" in res.stdout
    assert (proj / "rebase-pending.json").exists()
    assert (proj / "upstream.lock").read_text() == lock0
    early = rebase(proj, env, "--continue")
    assert early.returncode == 7
    assert "deleted upstream, still in the overlay: vllm/mod.py" in early.stderr
    (proj / "vllm_overlay/vllm/renamed").mkdir()
    (proj / "vllm_overlay/vllm/renamed/mod.py").write_text(OURS)
    (proj / "vllm_overlay/vllm/mod.py").unlink()
    res = rebase(proj, env, "--continue")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no longer in the overlay: vllm/mod.py (lock entry removed)" in res.stderr
    assert "not in upstream.lock yet: vllm/renamed/mod.py" in res.stderr
    lock = tomllib.loads((proj / "upstream.lock").read_text())
    assert lock["upstream"]["version"] == "0.23.1" and "vllm/mod.py" not in lock["overlay"]
    check = subprocess.run([sys.executable, "build.py", "check"], cwd=proj, env=env,
                           capture_output=True, text=True)
    sha = hashlib.sha256(BASE.encode()).hexdigest()
    assert check.returncode == 5
    assert f'[overlay."vllm/renamed/mod.py"] base_sha256 = "{sha}"' in check.stderr


def test_synthetic_deleted_upstream_abort(tmp_path):
    """--abort after the maintainer removed files puts back every overlay file and the
    lock."""
    proj, env = synthetic(tmp_path, {"vllm/renamed/mod.py": BASE})
    lock0, files0 = (proj / "upstream.lock").read_text(), overlay_snapshot(proj)
    assert rebase(proj, env, "--to", "0.23.1").returncode == 7
    (proj / "vllm_overlay/vllm/mod.py").unlink()
    res = rebase(proj, env, "--abort")
    assert res.returncode == 0, res.stderr
    assert overlay_snapshot(proj) == files0 and (proj / "upstream.lock").read_text() == lock0
    assert not (proj / "rebase-pending.json").exists()


def test_synthetic_pin_a_second_upstream(tmp_path):
    """`rebase --package vllm-gguf-plugin --to 0.0.3` pins the plugin beside vLLM (its
    wheel and sdist checked against the index); its overlay files then go under
    vllm_overlay/vllm_gguf_plugin/ and are checked against its wheel."""
    proj, env = synthetic(tmp_path, {"vllm/mod.py": BASE})
    res = rebase(proj, env, "--package", "vllm-gguf-plugin", "--to", "0.0.3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rebase vllm-gguf-plugin: not pinned -> 0.0.3" in res.stdout
    lock = tomllib.loads((proj / "upstream.lock").read_text())
    assert lock["upstream"]["version"] == "0.23.0"
    assert lock["plugin"]["package"] == "vllm-gguf-plugin"
    assert lock["plugin"]["wheels"]["manylinux_2_28_x86_64"]["filename"] == \
        "vllm_gguf_plugin-0.0.3-cp310-abi3-manylinux_2_28_x86_64.whl"
    assert lock["plugin"]["sdist"]["filename"] == "vllm_gguf_plugin-0.0.3.tar.gz"
    (proj / "vllm_overlay/vllm_gguf_plugin").mkdir()
    (proj / "vllm_overlay/vllm_gguf_plugin/mod.py").write_text(OURS)
    sha = hashlib.sha256(BASE.encode()).hexdigest()
    with open(proj / "upstream.lock", "a") as f:
        f.write(f'\n[overlay."vllm_gguf_plugin/mod.py"]\nbase_sha256 = "{sha}"\n')
    check = subprocess.run([sys.executable, "build.py", "check"], cwd=proj, env=env,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "vllm-gguf-plugin 0.0.3: ok, 1 replaced" in check.stderr
    third = rebase(proj, env, "--package", "other-plugin", "--to", "1.0")
    assert third.returncode == 5 and "would be a third upstream" in third.stderr


def reported_fates(stdout: str) -> dict[str, str]:
    """path -> result, from the lines of the text report that name a file."""
    return {path: fate for fate, path in re.findall(r"^  (\S+) +(\S+\.py)", stdout, re.M)}


def test_report_names_every_overlay_file(tmp_path):
    """The text report names every overlay file's fate: the other upstream's files as
    `other-upstream`, also those that import nothing that changed upstream."""
    proj, env = synthetic(tmp_path, {"vllm/mod.py": BASE.replace("d = 4", "d = 40")})
    assert rebase(proj, env, "--package", "vllm-gguf-plugin", "--to", "0.0.3").returncode == 0
    (proj / "vllm_overlay/vllm_gguf_plugin").mkdir()
    (proj / "vllm_overlay/vllm_gguf_plugin/extra.py").write_text("x = 1\n")
    with open(proj / "upstream.lock", "a") as f:
        f.write('\n[overlay."vllm_gguf_plugin/extra.py"]\nnew = true\n')
    res = rebase(proj, env, "--check", "0.23.1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert reported_fates(res.stdout) == {"vllm/mod.py": "clean", "vllm/extra.py": "new",
                                          "vllm_gguf_plugin/extra.py": "other-upstream"}


def test_unknown_release(tmp_path):
    proj, env = synthetic(tmp_path, {"vllm/mod.py": BASE})
    res = rebase(proj, env, "--to", "9.9.9")
    assert res.returncode == 3 and "vllm 9.9.9 is not on the package index" in res.stderr
