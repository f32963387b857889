# SPDX-License-Identifier: Apache-2.0
"""`build.py`: reproducible overlay wheels, refusal of bad input, installability.

The tests that build from the pinned upstream wheels (vLLM and vllm-gguf-plugin) use the
download cache of `build.py` (the first run downloads ~310 MB). The lock checks run on
small synthetic "upstream" wheels in a temporary project, so each case is fast.
"""

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = tomllib.loads((ROOT / "upstream.lock").read_text())
PLATFORM = "manylinux_2_28_x86_64"
PINNED = LOCK["upstream"]["wheels"][PLATFORM]
PINS = {"upstream": "vllm", "plugin": "vllm_gguf_plugin"}  # lock table -> wheel name


def run_build(*args, cwd=ROOT, cache=None, check=False):
    env = dict(os.environ)
    if cache is not None:
        env["VLLM_OVERLAY_CACHE"] = str(cache)
    res = subprocess.run(
        [sys.executable, str(Path(cwd) / "build.py"), *args],
        cwd=cwd, env=env, capture_output=True, text=True,
    )
    if check:
        assert res.returncode == 0, res.stderr
    return res


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_root() -> Path:
    base = os.environ.get("VLLM_OVERLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-overlay"
    )
    return Path(base)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Two builds of the real overlay wheels into different folders: for each, the
    wheels it printed by pin ("upstream": vLLM, "plugin": vllm-gguf-plugin)."""
    outs = [tmp_path_factory.mktemp(f"dist{i}") for i in range(2)]
    result = []
    for out in outs:
        res = run_build("wheel", "--out", str(out), "-q", check=True)
        paths = [Path(line) for line in res.stdout.split()]
        assert sorted(paths) == sorted(out.iterdir())
        result.append({key: next(p for p in paths if p.name.startswith(name + "-"))
                       for key, name in PINS.items()})
    return result


@pytest.fixture(scope="module")
def built(builds):
    """The vLLM overlay wheel of the two builds."""
    return [b["upstream"] for b in builds]


def read_record(zf: zipfile.ZipFile, info_dir: str):
    return list(csv.reader(io.StringIO(zf.read(info_dir + "RECORD").decode())))


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"="
    ).decode()


# --------------------------------------------------------------------------------------
# The real build
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pin", PINS)
def test_reproducible(builds, pin):
    a, b = builds[0][pin], builds[1][pin]
    assert a.name == b.name
    assert sha256(a) == sha256(b)


def test_wheel_name_and_version(builds):
    wheel = builds[0]["upstream"]
    up = LOCK["upstream"]
    assert wheel.name.startswith(f"vllm-{up['version']}+{up['label']}.")
    assert wheel.name.endswith("-cp38-abi3-manylinux_2_28_x86_64.whl")
    version = wheel.name.split("-")[1]
    digest = version.rsplit(".", 1)[1]
    plugin = builds[0]["plugin"]
    plugin_version = f"{LOCK['plugin']['version']}+{up['label']}.{digest}"
    assert plugin.name == f"vllm_gguf_plugin-{plugin_version}-cp310-abi3-{PLATFORM}.whl"
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"vllm-{version}.dist-info/METADATA").decode()
        assert f"\nVersion: {version}\n" in meta
        assert "Requires-Dist: transformers>=5.17.0,<5.18\n" in meta
        assert meta.count("Requires-Dist: transformers") == 1
        # exactly our plugin wheel, unconditionally (and for upstream's extra too)
        assert f"Requires-Dist: vllm-gguf-plugin=={plugin_version}\n" in meta
        assert all(line.startswith(f"Requires-Dist: vllm-gguf-plugin=={plugin_version}")
                   for line in meta.splitlines() if "vllm-gguf-plugin" in line)
        ver = zf.read("vllm/_version.py").decode()
        assert f"__version__ = version = '{version}'" in ver
        assert not any(n.startswith(f"vllm-{up['version']}.dist-info/") for n in zf.namelist())
    with zipfile.ZipFile(plugin) as zf:
        meta = zf.read(f"vllm_gguf_plugin-{plugin_version}.dist-info/METADATA").decode()
        assert f"\nVersion: {plugin_version}\n" in meta
        assert f"\nRequires-Dist: vllm=={version}\n" in meta
        assert "entry_points.txt" in " ".join(zf.namelist())


@pytest.mark.parametrize("pin", PINS)
def test_record_verifies(builds, pin):
    """Every member is in RECORD with its sha256 and size, and nothing else is."""
    wheel = builds[0][pin]
    version = wheel.name.split("-")[1]
    info = f"{PINS[pin]}-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as zf:
        assert zf.testzip() is None  # CRC of every member
        rows = read_record(zf, info)
        names = [i.filename for i in zf.infolist()]
        assert sorted(r[0] for r in rows) == sorted(names)
        assert len(set(names)) == len(names)
        for path, digest, size in rows:
            if path == info + "RECORD":
                assert digest == "" and size == ""
                continue
            data = zf.read(path)
            assert digest == record_hash(data), path
            assert int(size) == len(data), path


def test_overlay_files_in_wheel(builds):
    zips = {key: zipfile.ZipFile(path) for key, path in builds[0].items()}
    for rel in LOCK["overlay"]:
        key = next(k for k, name in PINS.items() if rel.startswith(name + "/"))
        assert zips[key].read(rel) == (ROOT / "vllm_overlay" / rel).read_bytes(), rel
    assert {n for n in zips["plugin"].namelist() if n.startswith("vllm/")} == set()


@pytest.mark.parametrize("pin", PINS)
def test_untouched_members_copied_verbatim(builds, pin):
    """Members the overlay does not touch keep upstream's compressed bytes."""
    upstream = cache_root() / "upstream" / LOCK[pin]["wheels"][PLATFORM]["filename"]
    touched = set(LOCK["overlay"]) | {"vllm/_version.py"}
    with zipfile.ZipFile(upstream) as up, zipfile.ZipFile(builds[0][pin]) as ours:
        theirs = {i.filename: i for i in up.infolist()}
        checked = 0
        for info in ours.infolist():
            src = theirs.get(info.filename)
            if src is None or info.filename in touched:
                continue
            assert (info.CRC, info.compress_size, info.compress_type) == (
                src.CRC, src.compress_size, src.compress_type), info.filename
            checked += 1
        assert checked > (1000 if pin == "upstream" else 50)


def test_cached_build_is_fast(tmp_path):
    # Not a benchmark: a guard that the cached build never recompresses the wheel
    # (a full recompression of ~1 GB takes minutes on the CI machine).
    import time

    run_build("wheel", "--out", str(tmp_path), "-q", check=True)
    t0 = time.monotonic()
    run_build("wheel", "--out", str(tmp_path), "-q", check=True)
    assert time.monotonic() - t0 < 60


def test_fresh_venv_install(builds, tmp_path):
    """pip installs both wheels into a new venv (`pip install dist/*.whl`): `import vllm`
    is the overlay, and vLLM's plugin loading registers our GGUF plugin with the glm-dsa
    adapter."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    # vLLM's dependencies (torch alone is GBs) come from this environment,
    # appended after the venv's own site-packages: pip must find them satisfied.
    # Without vllm and the plugin (a link to every other entry), so that pip installs them.
    deps = tmp_path / "dependencies"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not any(entry.name == n or entry.name.startswith(n + "-") for n in PINS.values()):
            (deps / entry.name).symlink_to(entry)
    Path(site, "zz_dependencies.pth").write_text(f"{deps}\n")
    wheels = [str(p) for p in builds[0].values()]
    alone = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-index", "--no-cache-dir", wheels[0]],
        capture_output=True, text=True,
    )
    assert alone.returncode != 0 and "vllm-gguf-plugin==" in alone.stdout + alone.stderr
    res = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-index", "--no-cache-dir", *wheels],
        capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    version = builds[0]["upstream"].name.split("-")[1]
    probe = (
        "import vllm, vllm.collect_env as ce, vllm.version as v\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.config.load import LoadConfig\n"
        "from vllm.model_executor.model_loader import get_model_loader\n"
        "load_general_plugins()\n"
        "import vllm_gguf_plugin.weights_adapter as wa\n"
        "loader = get_model_loader(LoadConfig(load_format='gguf'))\n"
        "cls = E.TRITON_MLA_SPARSE.get_class()\n"
        "print(vllm.__version__, vllm.__file__, cls.get_name(), ce.get_vllm_version(),"
        " v._prev_minor_version_was('0.25'), type(loader).__module__,"
        " '+'.join(a.__name__ for a in wa._ADAPTER_REGISTRY))\n"
    )
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ver, path, name, env_ver, prev, loader, adapters = out.stdout.split()[-7:]
    assert ver == version and env_ver == version
    assert Path(path).is_relative_to(venv)
    assert name == "TRITON_MLA_SPARSE" and prev == "True"
    assert loader == "vllm_gguf_plugin.loader" and "GlmDsaGGUFAdapter" in adapters.split("+")
    # the checked default adapter takes every model, so it is the registry's last
    assert adapters.split("+")[-1] == "CheckedGGUFWeightsAdapter"


# --------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------
def test_tampered_cache_refused(tmp_path):
    cache = tmp_path / "cache"
    (cache / "upstream").mkdir(parents=True)
    bad = cache / "upstream" / PINNED["filename"]
    shutil.copy(cache_root() / "upstream" / PINNED["filename"], bad)
    with open(bad, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "out"
    res = run_build("wheel", "--out", str(out), cache=cache)
    assert res.returncode == 4
    assert PINNED["filename"] in res.stderr
    assert PINNED["sha256"] in res.stderr and sha256(bad) in res.stderr
    assert not out.exists() or not any(out.iterdir())


def make_wheel(path: Path, version: str, files: dict[str, str],
               requires: tuple[str, ...] | list[str] = (), name: str = "vllm") -> None:
    """A small stand-in for an upstream wheel: files plus dist-info and RECORD."""
    info = f"{name.replace('-', '_')}-{version}.dist-info/"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {**files, info + "METADATA": meta,
             info + "WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"}
    rows = [[n, record_hash(d.encode()), str(len(d.encode()))] for n, d in files.items()]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows + [[info + "RECORD", "", ""]])
    files[info + "RECORD"] = buf.getvalue()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in files.items():
            zf.writestr(n, d)


def synthetic_lock(sdist_sha: str, wheel_sha: str, overlay: str) -> str:
    """upstream.lock pinning synthetic vllm 0.23.0 (x86_64 wheel only)."""
    return f"""
[upstream]
package = "vllm"
version = "0.23.0"
label = "dsa"
[upstream.sdist]
filename = "vllm-0.23.0.tar.gz"
sha256 = "{sdist_sha}"
[upstream.wheels.manylinux_2_28_x86_64]
filename = "vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"
sha256 = "{wheel_sha}"
{overlay}
"""


PLUGIN_WHEEL = "vllm_gguf_plugin-0.0.3-cp310-abi3-manylinux_2_28_x86_64.whl"


def synthetic_project(tmp_path, overlay: dict[str, str], lock_overlay: str,
                      upstream_files: dict[str, str],
                      plugin_files: dict[str, str] | None = None):
    """A project with build.py, a small fake upstream wheel in its own cache (and a fake
    vllm-gguf-plugin wheel pinned beside it, given `plugin_files`)."""
    proj, cache = tmp_path / "proj", tmp_path / "cache"
    (cache / "upstream").mkdir(parents=True)
    proj.mkdir()
    shutil.copy(ROOT / "build.py", proj / "build.py")
    shutil.copytree(ROOT / "tools", proj / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    name = "vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    make_wheel(cache / "upstream" / name, "0.23.0", {
        "vllm/__init__.py": "",
        "vllm/_version.py": "__version__ = version = '0.23.0'\n"
                            "__version_tuple__ = version_tuple = (0, 23, 0)\n",
        **upstream_files,
    }, requires=["torch==2.11.0", 'vllm-gguf-plugin>=0.0.2; extra == "extra-quant"'])
    plugin = ""
    if plugin_files is not None:
        make_wheel(cache / "upstream" / PLUGIN_WHEEL, "0.0.3",
                   {"vllm_gguf_plugin/__init__.py": "", **plugin_files},
                   requires=["gguf>=0.17.0", "vllm"], name="vllm-gguf-plugin")
        plugin = f"""
[plugin]
package = "vllm-gguf-plugin"
version = "0.0.3"
[plugin.sdist]
filename = "vllm_gguf_plugin-0.0.3.tar.gz"
sha256 = "{"0" * 64}"
[plugin.wheels.manylinux_2_28_x86_64]
filename = "{PLUGIN_WHEEL}"
sha256 = "{sha256(cache / "upstream" / PLUGIN_WHEEL)}"
"""
    (proj / "upstream.lock").write_text(
        synthetic_lock("0" * 64, sha256(cache / "upstream" / name), plugin + lock_overlay))
    for rel, text in overlay.items():
        path = proj / "vllm_overlay" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proj, cache


BASE = "a = 1\nb = 2\nc = 3\n"
BASE_SHA = hashlib.sha256(BASE.encode()).hexdigest()
OURS = "a = 1\n# overlay: why b changes\nb = 20\nc = 3\n"


def test_synthetic_build_ok(tmp_path):
    proj, cache = synthetic_project(
        tmp_path,
        {"vllm/mod.py": OURS, "vllm/new.py": "x = 1\n"},
        f'[overlay."vllm/mod.py"]\nbase_sha256 = "{BASE_SHA}"\n'
        '[overlay."vllm/new.py"]\nnew = true\n',
        {"vllm/mod.py": BASE},
    )
    res = run_build("wheel", "--out", str(tmp_path / "out"), "-q", cwd=proj, cache=cache)
    assert res.returncode == 0, res.stderr
    wheel = Path(res.stdout.strip())
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("vllm/mod.py").decode() == OURS
        assert zf.read("vllm/new.py").decode() == "x = 1\n"
        version = wheel.name.split("-")[1]
        assert "Requires-Dist: torch==2.11.0" in zf.read(
            f"vllm-{version}.dist-info/METADATA").decode()
    diff = run_build("diff", cwd=proj, cache=cache)
    assert diff.returncode == 0 and "+b = 20" in diff.stdout and "-b = 2" in diff.stdout


@pytest.mark.parametrize(
    "case,overlay,lock,upstream,needle",
    [
        ("drift", {"vllm/mod.py": OURS},
         f'[overlay."vllm/mod.py"]\nbase_sha256 = "{"1" * 64}"\n', {"vllm/mod.py": BASE},
         "vllm/mod.py: upstream file drifted"),
        ("unlisted", {"vllm/mod.py": OURS}, "", {"vllm/mod.py": BASE},
         "vllm_overlay/vllm/mod.py is not listed in upstream.lock"),
        ("missing", {}, f'[overlay."vllm/mod.py"]\nbase_sha256 = "{BASE_SHA}"\n',
         {"vllm/mod.py": BASE}, "vllm_overlay/vllm/mod.py does not exist"),
        ("escape", {"vllm/mod.py": OURS},
         f'[overlay."vllm/../evil.py"]\nbase_sha256 = "{BASE_SHA}"\n',
         {"vllm/mod.py": BASE}, "escapes the pinned packages (vllm/)"),
        ("outside", {"other/mod.py": "x = 1\n"}, "", {},
         "must live under vllm_overlay/vllm/"),
        ("no-marker", {"vllm/mod.py": "a = 1\nb = 20\nc = 3\n"},
         f'[overlay."vllm/mod.py"]\nbase_sha256 = "{BASE_SHA}"\n', {"vllm/mod.py": BASE},
         "changed hunk without an '# overlay:' comment"),
        ("new-but-upstream", {"vllm/mod.py": OURS}, '[overlay."vllm/mod.py"]\nnew = true\n',
         {"vllm/mod.py": BASE}, "is marked new but upstream has it"),
        ("deleted-upstream", {"vllm/mod.py": OURS},
         f'[overlay."vllm/mod.py"]\nbase_sha256 = "{BASE_SHA}"\n', {},
         "upstream vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl has no such file"),
        ("syntax", {"vllm/new.py": "def broken(:\n"}, '[overlay."vllm/new.py"]\nnew = true\n',
         {}, "vllm_overlay/vllm/new.py does not compile"),
        ("unsorted", {"vllm/mod.py": OURS, "vllm/new.py": "x = 1\n"},
         '[overlay."vllm/new.py"]\nnew = true\n'
         f'[overlay."vllm/mod.py"]\nbase_sha256 = "{BASE_SHA}"\n', {"vllm/mod.py": BASE},
         "overlay entry 'vllm/mod.py' belongs before 'vllm/new.py'"),
    ],
)
def test_lock_problems_refused(tmp_path, case, overlay, lock, upstream, needle):
    proj, cache = synthetic_project(tmp_path, overlay, lock, upstream)
    out = tmp_path / "out"
    for command in (["check"], ["wheel", "--out", str(out)]):
        res = run_build(*command, cwd=proj, cache=cache)
        assert res.returncode == 5, (command, res.stderr)
        assert needle in res.stderr, res.stderr
    assert not out.exists() or not any(out.iterdir())


def test_bad_label_refused(tmp_path):
    proj, cache = synthetic_project(tmp_path, {}, "", {})
    lock = proj / "upstream.lock"
    lock.write_text(lock.read_text().replace('label = "dsa"', 'label = "gpu1"'))
    res = run_build("check", cwd=proj, cache=cache)
    assert res.returncode == 5 and "not start with 'g'" in res.stderr


def test_unknown_platform_refused(tmp_path):
    res = run_build("check", "--platform", "win_amd64")
    assert res.returncode == 5 and "pins no wheel for platform 'win_amd64'" in res.stderr


def test_synthetic_two_upstreams(tmp_path):
    """Overlay files of the plugin live under vllm_overlay/vllm_gguf_plugin/: checked
    against the plugin's wheel, copied into it; both wheels carry one digest and
    require each other exactly (upstream's extra on the plugin included)."""
    proj, cache = synthetic_project(
        tmp_path,
        {"vllm/mod.py": OURS, "vllm_gguf_plugin/mod.py": OURS, "vllm_gguf_plugin/new.py": ""},
        f'[overlay."vllm/mod.py"]\nbase_sha256 = "{BASE_SHA}"\n'
        f'[overlay."vllm_gguf_plugin/mod.py"]\nbase_sha256 = "{BASE_SHA}"\n'
        '[overlay."vllm_gguf_plugin/new.py"]\nnew = true\n',
        {"vllm/mod.py": BASE}, {"vllm_gguf_plugin/mod.py": BASE})
    res = run_build("wheel", "--out", str(tmp_path / "out"), "-q", cwd=proj, cache=cache)
    assert res.returncode == 0, res.stderr
    vllm_whl, plugin_whl = (Path(line) for line in res.stdout.split())
    version, plugin_version = vllm_whl.name.split("-")[1], plugin_whl.name.split("-")[1]
    assert plugin_version == "0.0.3+dsa." + version.rsplit(".", 1)[1]
    with zipfile.ZipFile(vllm_whl) as zf:
        meta = zf.read(f"vllm-{version}.dist-info/METADATA").decode()
        assert "vllm_gguf_plugin/mod.py" not in zf.namelist()
    assert f"Requires-Dist: vllm-gguf-plugin=={plugin_version}\n" in meta
    assert f'Requires-Dist: vllm-gguf-plugin=={plugin_version}; extra == "extra-quant"' in meta
    with zipfile.ZipFile(plugin_whl) as zf:
        assert zf.read("vllm_gguf_plugin/mod.py").decode() == OURS
        meta = zf.read(f"vllm_gguf_plugin-{plugin_version}.dist-info/METADATA").decode()
    assert f"Requires-Dist: vllm=={version}\n" in meta and "Requires-Dist: gguf>=0.17.0" in meta
    diff = run_build("diff", "vllm_gguf_plugin/mod.py", cwd=proj, cache=cache)
    assert diff.returncode == 0 and "+++ b/vllm_gguf_plugin/mod.py" in diff.stdout
    # a plugin file without its marker, or drifted, is refused like a vLLM one
    (proj / "vllm_overlay/vllm_gguf_plugin/mod.py").write_text("a = 1\nb = 20\nc = 3\n")
    res = run_build("check", cwd=proj, cache=cache)
    assert res.returncode == 5 and "vllm_gguf_plugin/mod.py:2: changed hunk without" in res.stderr


def test_unlisted_file_names_its_lock_entry(tmp_path):
    proj, cache = synthetic_project(tmp_path, {"vllm/mod.py": OURS, "vllm/new.py": ""}, "",
                                    {"vllm/mod.py": BASE})
    res = run_build("check", cwd=proj, cache=cache)
    assert res.returncode == 5
    assert f'[overlay."vllm/mod.py"] base_sha256 = "{BASE_SHA}"' in res.stderr
    assert '[overlay."vllm/new.py"] new = true' in res.stderr


@pytest.mark.parametrize("edit,needle", [
    (('version = "0.23.0"', "version = 0.23"), "[upstream] version must be a quoted string"),
    (('version = "0.23.0"', 'version = "latest"'), "is not a release number"),
    (('filename = "vllm-0.23.0-cp38', 'name = "vllm-0.23.0-cp38'),
     '[upstream.wheels.manylinux_2_28_x86_64] needs filename = "..."'),
])
def test_bad_lock_values_refused(tmp_path, edit, needle):
    proj, cache = synthetic_project(tmp_path, {}, "", {})
    lock = proj / "upstream.lock"
    lock.write_text(lock.read_text().replace(*edit))
    for command in (["check"], ["wheel", "--out", str(tmp_path / "out")], ["diff"]):
        res = run_build(*command, cwd=proj, cache=cache)
        assert res.returncode == 5 and needle in res.stderr, (command, res.stderr)
        assert "Traceback" not in res.stderr


def test_bad_paths_refused(tmp_path):
    proj, cache = synthetic_project(tmp_path, {}, "", {})
    out = tmp_path / "out-file"
    out.write_text("not a folder")
    res = run_build("wheel", "--out", str(out), cwd=proj, cache=cache)
    assert res.returncode == 2 and "exists and is not a directory" in res.stderr
    assert "Traceback" not in res.stderr
    wheel = cache / "upstream" / "vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.rename(tmp_path / "moved.whl")
    wheel.mkdir()
    res = run_build("check", cwd=proj, cache=cache)
    assert res.returncode == 4 and "is not a file (a directory?)" in res.stderr
    assert "Traceback" not in res.stderr


def test_interrupted_runs_leave_nothing_behind(tmp_path):
    """Temporary files of a run that died (its process is gone) are removed by the next
    run; a live run's are kept."""
    proj, cache = synthetic_project(tmp_path, {}, "", {})
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = [out / f".building-{dead}-x1.whl", cache / "upstream" / f".partial-{dead}-x.whl"]
    live = out / f".building-{os.getpid()}-x2.whl"
    for p in (*stale, live):
        p.write_bytes(b"partial")
    res = run_build("wheel", "--out", str(out), "-q", cwd=proj, cache=cache)
    assert res.returncode == 0, res.stderr
    assert not any(p.exists() for p in stale) and live.exists()


def test_diff_into_a_closed_pipe(tmp_path):
    """`build.py diff | head`: the reader stops early; no BrokenPipeError traceback."""
    proj, cache = synthetic_project(
        tmp_path, {"vllm/mod.py": OURS * 200},
        f'[overlay."vllm/mod.py"]\nbase_sha256 = "{BASE_SHA}"\n', {"vllm/mod.py": BASE})
    env = dict(os.environ, VLLM_OVERLAY_CACHE=str(cache))
    res = subprocess.run(f"{sys.executable} build.py diff | head -1", shell=True, cwd=proj,
                         env=env, capture_output=True, text=True)
    assert res.stdout.startswith("--- a/vllm/mod.py") and "Traceback" not in res.stderr
    assert "BrokenPipe" not in res.stderr


def test_check_passes_on_repository():
    res = run_build("check")
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------------------
# Offline bundle
# --------------------------------------------------------------------------------------
def test_bundle_only_and_drop(builds, tmp_path):
    """A bundle for a host whose `pip freeze` is given: checksummed parts that
    reassemble into the slimmed vLLM wheel, the plugin wheel, only the pins the host
    lacks, and an install script that installs them."""
    built = [builds[0]["upstream"], builds[0]["plugin"]]
    import tarfile

    freeze = tmp_path / "freeze.txt"
    freeze.write_text("six==1.16.0\nnumpy==2.0.0\n-e git+https://example.invalid/x#egg=x\n")
    only = tmp_path / "only.txt"
    only.write_text("# runtime extras\nsix==1.16.0\nannotated-types==0.7.0\n")
    out = tmp_path / "bundle"
    res = run_build("bundle", "--wheel", str(built[0]), "--wheel", str(built[1]),
                    "--exclude-from", str(freeze),
                    "--only", str(only), "--drop", "vllm/vllm-rs", "--max-part", "50M",
                    "--out", str(out))
    assert res.returncode == 0, res.stderr
    parts = sorted(out.glob("part-*"))
    assert len(parts) > 1 and all(p.stat().st_size <= 50 * 2**20 for p in parts)
    sums = dict(line.split()[::-1] for line in (out / "SHA256SUMS").read_text().splitlines())
    assert sums == {p.name: sha256(p) for p in parts}
    joined = tmp_path / "bundle.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    wheels = sorted(p.name for p in (tmp_path / "x/bundle/wheels").iterdir())
    assert wheels[0].startswith("annotated_types-0.7.0-")
    assert wheels[1:] == [built[0].name, built[1].name]  # six is on the host already
    slim = tmp_path / "x/bundle/wheels" / built[0].name
    with zipfile.ZipFile(slim) as zf:
        names = set(zf.namelist())
        assert "vllm/vllm-rs" not in names
        info = next(n for n in names if n.endswith(".dist-info/RECORD"))
        assert {r[0] for r in read_record(zf, info.rsplit("/", 1)[0] + "/")} == names
    # A corrupted part is refused before anything is installed.
    site = tmp_path / "site"
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    with open(bad / "part-00", "r+b") as f:
        f.write(b"\0")
    res = subprocess.run(["bash", str(bad / "install.sh"), str(bad), str(site)],
                         capture_output=True, text=True)
    assert res.returncode != 0 and not site.exists()
    res = subprocess.run(["bash", str(out / "install.sh"), str(out), str(site)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    version = built[0].name.split("-")[1]
    assert f"vllm {version} installed" in res.stdout
    env_sh = (site / "env.sh").read_text()
    assert env_sh.startswith(f'export PYTHONPATH="{site}')
    res = subprocess.run(["bash", "-c", f"source {site}/env.sh && command -v vllm"],
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == str(site / "bin" / "vllm"), res


def test_bundle_bad_input(tmp_path):
    res = run_build("bundle", "--wheel", str(tmp_path / "missing.whl"),
                    "--exclude-from", str(tmp_path / "freeze.txt"), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "missing.whl: no such file" in res.stderr
    assert not (tmp_path / "o").exists()


def test_bundle_resolves_dependency_closure(tmp_path):
    """Default mode: pip resolves the wheel's dependencies for the target and the
    bundle carries exactly those the freeze lacks."""
    from importlib.metadata import version

    if int(version("pip").split(".")[0]) < 25:
        pytest.skip("resolving for another platform needs pip >= 25 (CI upgrades it)")
    meta = ("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
            "Requires-Dist: six==1.16.0\nRequires-Dist: annotated-types==0.7.0\n")
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    files = {"demo/__init__.py": "", "demo-1.0.dist-info/METADATA": meta,
             "demo-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    rows = [[n, record_hash(d.encode()), str(len(d))] for n, d in files.items()]
    files["demo-1.0.dist-info/RECORD"] = "".join(",".join(r) + "\n" for r in rows) + \
        "demo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("six==1.16.0\n")
    out = tmp_path / "bundle"
    res = run_build("bundle", "--wheel", str(wheel), "--exclude-from", str(freeze),
                    "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "the target lacks 1 packages" in res.stderr
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(b"".join(
            p.read_bytes() for p in sorted(out.glob("part-*"))))) as tar:
        names = sorted(n for n in tar.getnames() if n.endswith(".whl"))
    assert [n.split("/")[-1].split("-")[0] for n in names] == ["annotated_types", "demo"]
