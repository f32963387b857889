"""`python build.py rebase`: carry the overlay onto another upstream release.

For every overlay file that replaces an upstream file: a three-way merge (`git merge-file`)
with base = the file in the pinned upstream wheel, ours = the overlay file, theirs = the file
in the new release's wheel. New overlay files are kept unless upstream now has a file at
their path. upstream.lock gets the new pin (wheel and sdist sha256 as listed on the index)
and new base hashes only when everything merged cleanly, or with --allow-conflicts.
Conflicts are written with markers and the rebase waits, as `git rebase` does: resolve
them, then `--continue` (moves the pin) or `--abort` (restores the overlay files).
Files upstream deleted, or added at an overlay path, stop the rebase before anything
is written.
The report (text on stdout, JSON with --report) lists per file the result and hunks, and the
upstream modules imported by overlay files that changed between the two releases.
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import json
import re
import subprocess
import tempfile
import zipfile
from pathlib import Path

import build as b

CONFLICT_RE = re.compile(r"^(<<<<<<< |>>>>>>> )", re.M)


def release_files(package: str, version: str, platforms: list[str]) -> dict:
    """sdist and per-platform wheel of `version` from the index, with their sha256."""
    files = b.index_files(package)
    sdist = f"{package}-{version}.tar.gz"
    if sdist not in files:
        raise b.BuildError(f"{package} {version} is not on the package index (no {sdist})",
                           b.EXIT_DOWNLOAD)
    wheels = {}
    for plat in platforms:
        plain = f"{package}-{version}-cp38-abi3-{plat}.whl"
        tagged = sorted(n for n in files if n.startswith(f"{package}-{version}-")
                        and n.endswith(f"-{plat}.whl"))
        name = plain if plain in files else (tagged[0] if tagged else None)
        if name is None:
            raise b.BuildError(f"{package} {version} has no wheel for {plat} on the index",
                               b.EXIT_DOWNLOAD)
        wheels[plat] = {"filename": name, "sha256": files[name]["sha256"]}
    return {"sdist": {"filename": sdist, "sha256": files[sdist]["sha256"]}, "wheels": wheels}


def latest_version(package: str) -> str:
    versions = set()
    for name in b.index_files(package):
        m = re.fullmatch(rf"{package}-(\d+(?:\.\d+)*)\.tar\.gz", name)
        if m:
            versions.add(m.group(1))
    return max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))


def merge(base: str, ours: str, theirs: str, labels: tuple[str, str, str]) -> tuple[str, int]:
    """Three-way merge with git merge-file; returns (text, number of conflicts)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name, text in (("ours", ours), ("base", base), ("theirs", theirs)):
            p = Path(tmp) / name
            p.write_text(text)
            paths.append(str(p))
        res = subprocess.run(["git", "merge-file", "-p", "-L", labels[0], "-L", labels[1],
                              "-L", labels[2], *paths], capture_output=True, text=True)
    if res.returncode < 0 or res.returncode > 127:
        raise b.BuildError(f"git merge-file failed: {res.stderr.strip()}", b.EXIT_LOCK)
    return res.stdout, res.returncode


def hunks(a: str, b_: str) -> int:
    ops = difflib.SequenceMatcher(None, a.splitlines(), b_.splitlines(),
                                  autojunk=False).get_opcodes()
    return sum(1 for op in ops if op[0] != "equal")


def imported_modules(source: str, rel: str) -> set[str]:
    """vllm.* modules a file imports (relative imports resolved against its path)."""
    package = rel[:-3].replace("/", ".").rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == "vllm"}


def module_file(module: str, names: set[str]) -> str | None:
    path = module.replace(".", "/")
    for cand in (f"{path}.py", f"{path}/__init__.py"):
        if cand in names:
            return cand
    return None


def rebase(to: str, allow_conflicts: bool, dry_run: bool, report_path: Path | None) -> int:
    if PENDING.exists() and not dry_run:
        raise b.BuildError("a rebase is in progress: resolve the conflicts and run "
                           "`build.py rebase --continue`, or `--abort`", b.EXIT_REBASE)
    lock = b.load_lock()
    up = lock["upstream"]
    if to == "latest":
        to = latest_version(up["package"])
    if to == up["version"]:
        b.log(f"[rebase] already at {to}")
    new = release_files(up["package"], to, sorted(up["wheels"]))
    platform = b.DEFAULT_PLATFORM if b.DEFAULT_PLATFORM in up["wheels"] else sorted(up["wheels"])[0]
    old_wheel = b.fetch_wheel(lock, platform)
    new_wheel = b.fetch(up["package"], **new["wheels"][platform])
    b.fetch(up["package"], **new["sdist"])  # verify it too: the lock will pin it

    files = b.overlay_files()
    results, writes = [], {}
    with zipfile.ZipFile(old_wheel) as old_zf, zipfile.ZipFile(new_wheel) as new_zf:
        old_names, new_names = set(old_zf.namelist()), set(new_zf.namelist())
        for rel, entry in sorted(lock["overlay"].items()):
            ours = files[rel].read_text() if rel in files else None
            row = {"path": rel, "kind": "new" if entry.get("new") is True else "replaced"}
            if ours is None:
                row["result"] = "missing-in-overlay"
            elif row["kind"] == "new":
                row["result"] = "added-upstream" if rel in new_names else "new"
            elif rel not in new_names:
                base_name = rel.rsplit("/", 1)[-1]
                row["result"] = "deleted-upstream"
                row["candidates"] = sorted(n for n in new_names - old_names
                                           if n.endswith("/" + base_name))
            else:
                base = old_zf.read(rel).decode()
                if hashlib.sha256(base.encode()).hexdigest() != entry["base_sha256"]:
                    raise b.BuildError(f"{rel}: the pinned wheel does not hold the recorded "
                                       f"base; run `build.py check`", b.EXIT_LOCK)
                theirs = new_zf.read(rel).decode()
                row["new_base_sha256"] = hashlib.sha256(theirs.encode()).hexdigest()
                row["hunks_ours"] = hunks(base, ours)
                row["hunks_upstream"] = hunks(base, theirs)
                if theirs == base:
                    row["result"] = "upstream-unchanged"
                else:
                    merged, conflicts = merge(base, ours, theirs,
                                              ("overlay", f"upstream {up['version']}",
                                               f"upstream {to}"))
                    row["result"] = "conflict" if conflicts else "clean"
                    row["conflicts"] = conflicts
                    writes[rel] = merged
            if ours is not None:
                changed = []
                for mod in sorted(imported_modules(ours, rel)):
                    path = module_file(mod, old_names | new_names)
                    if path is None or path == rel:
                        continue
                    a = old_zf.read(path) if path in old_names else None
                    c = new_zf.read(path) if path in new_names else None
                    if a != c:
                        changed.append(path if c is not None else f"{path} (deleted)")
                row["imports_changed_upstream"] = sorted(set(changed))
            results.append(row)

    blocking = [r for r in results
                if r["result"] in ("conflict", "deleted-upstream", "added-upstream",
                                   "missing-in-overlay")]
    report = {"from": up["version"], "to": to, "wheel": new["wheels"][platform],
              "sdist": new["sdist"], "files": results, "clean": not blocking,
              "lock_updated": False, "dry_run": dry_run}
    structural = [r for r in blocking if r["result"] != "conflict"]
    new_bases = {r["path"]: r["new_base_sha256"] for r in results if "new_base_sha256" in r}
    # Files upstream deleted, or added at an overlay path, need a decision first:
    # then nothing is written (unless --allow-conflicts).
    if not dry_run and (not structural or allow_conflicts):
        originals = {rel: files[rel].read_text() for rel in writes}
        for rel, text in writes.items():
            b.write_atomic(files[rel], text.encode())
        report["written"] = sorted(writes)
        if blocking and not allow_conflicts:
            # Conflicts only: like `git rebase`, resolve the markers, then --continue
            # (or --abort to restore the overlay files).
            state = {"to": to, "sdist": new["sdist"], "wheels": new["wheels"],
                     "bases": new_bases, "originals": originals}
            b.write_atomic(PENDING, (json.dumps(state, indent=1) + "\n").encode())
        else:
            update_lock(lock, to, new["sdist"], new["wheels"], new_bases)
            report["lock_updated"] = True

    print(f"rebase {up['version']} -> {to}{' (dry run)' if dry_run else ''}")
    for r in results:
        extra = f", {r['conflicts']} conflicts" if r.get("conflicts") else ""
        hunk = (f" (overlay {r['hunks_ours']} hunks, upstream {r['hunks_upstream']} hunks{extra})"
                if "hunks_ours" in r else "")
        print(f"  {r['result']:20s} {r['path']}{hunk}")
        if r.get("candidates"):
            print(f"  {'':20s}   new upstream files of the same name: {', '.join(r['candidates'])}")
        for dep in r.get("imports_changed_upstream", []):
            print(f"  {'':20s}   re-test: imports {dep}, which changed upstream")
    print(f"lock {'updated' if report['lock_updated'] else 'not updated'}"
          + ("" if not blocking else f"; {len(blocking)} file(s) need a maintainer"))
    if PENDING.exists() and not dry_run:
        print("conflicts written with markers: resolve them, then `python build.py rebase "
              "--continue` (or --abort)")
    if report_path:
        b.write_atomic(report_path, (json.dumps(report, indent=1) + "\n").encode())
    return 0 if not blocking else b.EXIT_REBASE


PENDING = b.ROOT / "rebase-pending.json"


def update_lock(lock: dict, to: str, sdist: dict, wheels: dict, bases: dict) -> None:
    lock["upstream"].update(version=to, sdist=sdist, wheels=wheels)
    for rel, sha in bases.items():
        lock["overlay"][rel]["base_sha256"] = sha
    b.write_atomic(b.LOCK, dump_lock(lock).encode())


def resume(abort: bool) -> int:
    """--continue: the conflicts are resolved, move the pin; --abort: restore the files."""
    if not PENDING.exists():
        raise b.BuildError("no rebase in progress", b.EXIT_REBASE)
    state = json.loads(PENDING.read_text())
    files = b.overlay_files()
    if abort:
        for rel, text in state["originals"].items():
            b.write_atomic(files[rel], text.encode())
        PENDING.unlink()
        b.log(f"[rebase] aborted; {len(state['originals'])} overlay files restored")
        return 0
    left = [rel for rel in state["originals"]
            if CONFLICT_RE.search(files[rel].read_text())]
    if left:
        raise b.BuildError("unresolved conflict markers in: " + ", ".join(left), b.EXIT_REBASE)
    update_lock(b.load_lock(), state["to"], state["sdist"], state["wheels"], state["bases"])
    PENDING.unlink()
    b.log(f"[rebase] upstream.lock now pins {state['to']}; run `python build.py check`")
    return 0


def toml_str(value: str) -> str:
    return json.dumps(value)  # TOML basic strings share JSON's escapes for what we store


def dump_lock(lock: dict) -> str:
    up = lock["upstream"]
    out = [
        "# The pinned upstream vLLM release and the base of every overlay file.",
        "# `python build.py check` verifies this file against vllm_overlay/ and the pinned wheel;",
        "# `python build.py rebase --to X.Y.Z` rewrites it. Hashes are sha256 of the files on the"
        " package index.",
        "",
        "[upstream]",
        f"package = {toml_str(up['package'])}",
        f"version = {toml_str(up['version'])}",
        "# PEP 440 local label: the overlay wheel is <version>+<label>.<overlay digest>",
        f"label = {toml_str(up['label'])}",
        "",
        "[upstream.sdist]",
        f"filename = {toml_str(up['sdist']['filename'])}",
        f"sha256 = {toml_str(up['sdist']['sha256'])}",
    ]
    for plat, wheel in sorted(up["wheels"].items()):
        out += ["", f"[upstream.wheels.{plat}]", f"filename = {toml_str(wheel['filename'])}",
                f"sha256 = {toml_str(wheel['sha256'])}"]
    out += ["", "# Requirements of the overlay wheel that differ from upstream's METADATA "
            "(by project name).", "[requires]"]
    out += [f"{k} = {toml_str(v)}" for k, v in sorted(lock["requires"].items())]
    out += ["", "# Overlay files, by their path in the wheel. A file that replaces an upstream "
            "file records the sha256", "# of the upstream file it was made from (base_sha256); "
            "a file upstream does not have is new = true."]
    for rel, entry in sorted(lock["overlay"].items()):
        out += ["", f"[overlay.{toml_str(rel)}]"]
        out += ["new = true"] if entry.get("new") is True else \
            [f"base_sha256 = {toml_str(entry['base_sha256'])}"]
    return "\n".join(out) + "\n"
