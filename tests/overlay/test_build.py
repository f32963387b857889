# SPDX-License-Identifier: Apache-2.0
"""`build.py`: reproducible overlay wheel, refusal of bad input, installability.

The tests that build from the pinned upstream wheel use the download cache of
`build.py` (the first run downloads ~274 MB). The lock checks run on a small
synthetic "upstream" wheel in a temporary project, so each case is fast.
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
def built(tmp_path_factory):
    """Two builds of the real overlay wheel into different folders."""
    outs = [tmp_path_factory.mktemp(f"dist{i}") for i in range(2)]
    wheels = []
    for out in outs:
        res = run_build("wheel", "--out", str(out), "-q", check=True)
        wheels.append(Path(res.stdout.strip()))
    return wheels


def read_record(zf: zipfile.ZipFile, info_dir: str):
    return list(csv.reader(io.StringIO(zf.read(info_dir + "RECORD").decode())))


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"="
    ).decode()


# --------------------------------------------------------------------------------------
# The real build
# --------------------------------------------------------------------------------------
def test_reproducible(built):
    a, b = built
    assert a.name == b.name
    assert sha256(a) == sha256(b)


def test_wheel_name_and_version(built):
    wheel = built[0]
    up = LOCK["upstream"]
    assert wheel.name.startswith(f"vllm-{up['version']}+{up['label']}.")
    assert wheel.name.endswith("-cp38-abi3-manylinux_2_28_x86_64.whl")
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"vllm-{version}.dist-info/METADATA").decode()
        assert f"\nVersion: {version}\n" in meta
        assert "Requires-Dist: transformers>=5.17.0,<5.18\n" in meta
        assert meta.count("Requires-Dist: transformers") == 1
        ver = zf.read("vllm/_version.py").decode()
        assert f"__version__ = version = '{version}'" in ver
        assert not any(n.startswith(f"vllm-{up['version']}.dist-info/") for n in zf.namelist())


def test_record_verifies(built):
    """Every member is in RECORD with its sha256 and size, and nothing else is."""
    wheel = built[0]
    version = wheel.name.split("-")[1]
    info = f"vllm-{version}.dist-info/"
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


def test_overlay_files_in_wheel(built):
    with zipfile.ZipFile(built[0]) as zf:
        for rel in LOCK["overlay"]:
            assert zf.read(rel) == (ROOT / "vllm_overlay" / rel).read_bytes(), rel


def test_untouched_members_copied_verbatim(built):
    """Members the overlay does not touch keep upstream's compressed bytes."""
    upstream = cache_root() / "upstream" / PINNED["filename"]
    touched = set(LOCK["overlay"]) | {"vllm/_version.py"}
    with zipfile.ZipFile(upstream) as up, zipfile.ZipFile(built[0]) as ours:
        theirs = {i.filename: i for i in up.infolist()}
        checked = 0
        for info in ours.infolist():
            src = theirs.get(info.filename)
            if src is None or info.filename in touched:
                continue
            assert (info.CRC, info.compress_size, info.compress_type) == (
                src.CRC, src.compress_size, src.compress_type), info.filename
            checked += 1
        assert checked > 1000


def test_cached_build_is_fast(tmp_path):
    # Not a benchmark: a guard that the cached build never recompresses the wheel
    # (a full recompression of ~1 GB takes minutes on the CI machine).
    import time

    run_build("wheel", "--out", str(tmp_path), "-q", check=True)
    t0 = time.monotonic()
    run_build("wheel", "--out", str(tmp_path), "-q", check=True)
    assert time.monotonic() - t0 < 60


def test_fresh_venv_install(built, tmp_path):
    """pip installs the wheel into a new venv; `import vllm` is the overlay."""
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
    # Without vllm itself (a link to every other entry), so that pip installs it.
    deps = tmp_path / "dependencies"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name != "vllm" and not entry.name.startswith("vllm-"):
            (deps / entry.name).symlink_to(entry)
    Path(site, "zz_dependencies.pth").write_text(f"{deps}\n")
    res = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-index", "--no-cache-dir", str(built[0])],
        capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    version = built[0].name.split("-")[1]
    probe = (
        "import vllm, vllm.collect_env as ce, vllm.version as v\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "cls = E.TRITON_MLA_SPARSE.get_class()\n"
        "print(vllm.__version__, vllm.__file__, cls.get_name(), ce.get_vllm_version(),"
        " v._prev_minor_version_was('0.22'))\n"
    )
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ver, path, name, env_ver, prev = out.stdout.split()[-5:]
    assert ver == version and env_ver == version
    assert Path(path).is_relative_to(venv)
    assert name == "TRITON_MLA_SPARSE" and prev == "True"


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
               requires: tuple[str, ...] | list[str] = ()) -> None:
    """A small stand-in for an upstream vLLM wheel: files plus dist-info and RECORD."""
    info = f"vllm-{version}.dist-info/"
    meta = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n" + "".join(
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


def synthetic_project(tmp_path, overlay: dict[str, str], lock_overlay: str,
                      upstream_files: dict[str, str]):
    """A project with build.py, a small fake upstream wheel in its own cache."""
    proj, cache = tmp_path / "proj", tmp_path / "cache"
    (cache / "upstream").mkdir(parents=True)
    proj.mkdir()
    shutil.copy(ROOT / "build.py", proj / "build.py")
    name = "vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    make_wheel(cache / "upstream" / name, "0.23.0", {
        "vllm/__init__.py": "",
        "vllm/_version.py": "__version__ = version = '0.23.0'\n"
                            "__version_tuple__ = version_tuple = (0, 23, 0)\n",
        **upstream_files,
    }, requires=["torch==2.11.0"])
    (proj / "upstream.lock").write_text(
        synthetic_lock("0" * 64, sha256(cache / "upstream" / name), lock_overlay))
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
         {"vllm/mod.py": BASE}, "escapes vllm/"),
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


def test_check_passes_on_repository():
    res = run_build("check")
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------------------
# Offline bundle
# --------------------------------------------------------------------------------------
def test_bundle_only_and_drop(built, tmp_path):
    """A bundle for a host whose `pip freeze` is given: checksummed parts that
    reassemble into the slimmed wheel plus only the pins the host lacks, and an
    install script that installs them."""
    import tarfile

    freeze = tmp_path / "freeze.txt"
    freeze.write_text("six==1.16.0\nnumpy==2.0.0\n-e git+https://example.invalid/x#egg=x\n")
    only = tmp_path / "only.txt"
    only.write_text("# runtime extras\nsix==1.16.0\nannotated-types==0.7.0\n")
    out = tmp_path / "bundle"
    res = run_build("bundle", "--wheel", str(built[0]), "--exclude-from", str(freeze),
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
    assert wheels[0].startswith("annotated_types-0.7.0-") and wheels[1] == built[0].name
    assert len(wheels) == 2  # six is on the host already
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
