"""`python build.py rebase`: carry the overlay onto another upstream release.

upstream.lock pins vLLM ([upstream]) and, optionally, vllm-gguf-plugin ([plugin]); a
rebase moves one of them (`--package`, default vllm). For every overlay file of that
package that replaces an upstream file: a three-way merge (`git merge-file`) with base =
the file in the pinned upstream wheel, ours = the overlay file, theirs = the file in the
new release's wheel. New overlay files are kept unless upstream now has a file at their
path. upstream.lock gets the new pin (wheel and sdist sha256 as listed on the index) and
new base hashes only when everything merged cleanly, or with --allow-conflicts. A package
the lock does not pin yet is pinned by its first rebase (it has no overlay files then).

Files that need a maintainer make the rebase wait, as `git rebase` does:
- conflicts are written with markers: resolve them;
- a replaced file upstream deleted: its change must move to where the mechanism lives now
  (another upstream file, the plugin, a new file); then remove the overlay file;
then `--continue` (moves the pin, drops the lock entries of overlay files the maintainer
removed, reports added ones) or `--abort` (restores the overlay files and the lock). A new
overlay file at a path upstream now has stops the rebase before anything is written.
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

from tools.common import (EXIT_DOWNLOAD, EXIT_LOCK, EXIT_REBASE, BuildError, dist_name, log,
                          normalized_name, write_atomic)
from tools.upstream import (DEFAULT_PLATFORM, LOCK, OVERLAY, ROOT, fetch, fetch_wheel,
                            index_files, load_lock, module_name, overlay_files, pin_of, pins)

CONFLICT_RE = re.compile(r"^(<<<<<<< |>>>>>>> )", re.M)


def release_files(package: str, version: str, platforms: list[str]) -> dict:
    """sdist and per-platform wheel of `version` from the index, with their sha256."""
    files = index_files(package)
    dist = dist_name(package)
    sdists = [n for n in (f"{package}-{version}.tar.gz", f"{dist}-{version}.tar.gz")
              if n in files]
    if not sdists:
        raise BuildError(f"{package} {version} is not on the package index (no "
                         f"{dist}-{version}.tar.gz)", EXIT_DOWNLOAD)
    wheels = {}
    for plat in platforms:
        plain = f"{dist}-{version}-cp38-abi3-{plat}.whl"
        tagged = sorted(n for n in files if n.startswith(f"{dist}-{version}-")
                        and n.endswith(f"-{plat}.whl"))
        name = plain if plain in files else (tagged[0] if tagged else None)
        if name is None:
            raise BuildError(f"{package} {version} has no wheel for {plat} on the index",
                             EXIT_DOWNLOAD)
        wheels[plat] = {"filename": name, "sha256": files[name]["sha256"]}
    sdist = sdists[0]
    return {"sdist": {"filename": sdist, "sha256": files[sdist]["sha256"]}, "wheels": wheels}


def latest_version(package: str) -> str:
    versions = set()
    names = (re.escape(package), re.escape(dist_name(package)))
    for name in index_files(package):
        m = re.fullmatch(rf"(?:{'|'.join(names)})-(\d+(?:\.\d+)*)\.tar\.gz", name)
        if m:
            versions.add(m.group(1))
    if not versions:
        raise BuildError(f"no release of {package} on the package index", EXIT_DOWNLOAD)
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
        raise BuildError(f"git merge-file failed: {res.stderr.strip()}", EXIT_LOCK)
    return res.stdout, res.returncode


def hunks(a: str, b_: str) -> int:
    ops = difflib.SequenceMatcher(None, a.splitlines(), b_.splitlines(),
                                  autojunk=False).get_opcodes()
    return sum(1 for op in ops if op[0] != "equal")


def imported_modules(source: str, rel: str, top: str) -> set[str]:
    """`top`.* modules a file imports (relative imports resolved against its path)."""
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
    return {m for m in found if m.split(".")[0] == top}


def module_file(module: str, names: set[str]) -> str | None:
    path = module.replace(".", "/")
    for cand in (f"{path}.py", f"{path}/__init__.py"):
        if cand in names:
            return cand
    return None


def pin_key(lock: dict, package: str) -> str:
    """The lock table that pins `package`: [upstream] for vLLM, [plugin] for the other."""
    for key in pins(lock):
        if normalized_name(lock[key]["package"]) == normalized_name(package):
            return key
    if "plugin" in lock:
        raise BuildError(f"upstream.lock pins {lock['upstream']['package']} and "
                         f"{lock['plugin']['package']}; {package} would be a third upstream",
                         EXIT_LOCK)
    return "plugin"


def rebase(to: str, *, package: str = "vllm", dry_run: bool = False,
           allow_conflicts: bool = False, report_path: Path | None = None) -> int:
    """Move `package`'s pin to release `to` ("latest": the newest on the index) and merge its
    overlay files; `dry_run` only reports."""
    if PENDING.exists() and not dry_run:
        raise BuildError("a rebase is in progress: resolve the conflicts and run "
                         "`build.py rebase --continue`, or `--abort`", EXIT_REBASE)
    lock = load_lock()
    key = pin_key(lock, package)
    if key not in lock:
        return pin_new(lock, key, package, to, dry_run=dry_run, report_path=report_path)
    up = lock[key]
    top = module_name(up["package"])
    if to == "latest":
        to = latest_version(up["package"])
    if to == up["version"]:
        log(f"[rebase] already at {to}")
    platforms = sorted(lock["upstream"]["wheels"])
    new = release_files(up["package"], to, platforms)
    platform = DEFAULT_PLATFORM if DEFAULT_PLATFORM in up["wheels"] else sorted(up["wheels"])[0]
    old_wheel = fetch_wheel(lock, platform, key)
    new_wheel = fetch(up["package"], **new["wheels"][platform])
    fetch(up["package"], **new["sdist"])  # verify it too: the lock will pin it

    files = overlay_files(lock)
    results, writes = [], {}
    with zipfile.ZipFile(old_wheel) as old_zf, zipfile.ZipFile(new_wheel) as new_zf:
        old_names, new_names = set(old_zf.namelist()), set(new_zf.namelist())
        for rel, entry in sorted(lock["overlay"].items()):
            mine = pin_of(lock, rel) == key
            ours = files[rel].read_text() if rel in files else None
            row = {"path": rel, "kind": "new" if entry.get("new") is True else "replaced"}
            if not mine:
                row["result"] = "other-upstream"
            elif ours is None:
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
                    raise BuildError(f"{rel}: the pinned wheel does not hold the recorded "
                                     f"base; run `build.py check`", EXIT_LOCK)
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
                # every overlay file that imports this upstream: re-test what changed under it
                changed = []
                for mod in sorted(imported_modules(ours, rel, top)):
                    path = module_file(mod, old_names | new_names)
                    if path is None or path == rel:
                        continue
                    a = old_zf.read(path) if path in old_names else None
                    c = new_zf.read(path) if path in new_names else None
                    if a != c:
                        changed.append(path if c is not None else f"{path} (deleted)")
                row["imports_changed_upstream"] = sorted(set(changed))
            results.append(row)

    waiting = [r for r in results if r["result"] in ("conflict", "deleted-upstream")]
    blocking = waiting + [r for r in results
                          if r["result"] in ("added-upstream", "missing-in-overlay")]
    report = {"package": up["package"], "from": up["version"], "to": to,
              "wheel": new["wheels"][platform], "sdist": new["sdist"], "files": results,
              "clean": not blocking, "lock_updated": False, "dry_run": dry_run}
    structural = [r for r in blocking if r["result"] in ("added-upstream", "missing-in-overlay")]
    new_bases = {r["path"]: r["new_base_sha256"] for r in results if "new_base_sha256" in r}
    # A new overlay file upstream now has, or a listed file that is gone, needs a decision
    # first: then nothing is written (unless --allow-conflicts).
    if not dry_run and (not structural or allow_conflicts):
        # what --abort puts back: every overlay file of this upstream (the maintainer may
        # remove some while resolving)
        originals = {rel: path.read_text() for rel, path in files.items()
                     if pin_of(lock, rel) == key}
        for rel, text in writes.items():
            write_atomic(files[rel], text.encode())
        report["written"] = sorted(writes)
        if waiting and not allow_conflicts:
            # Like `git rebase`: resolve the markers and move deleted files' changes, then
            # --continue (or --abort to restore the overlay files).
            state = {"package": up["package"], "key": key, "to": to, "sdist": new["sdist"],
                     "wheels": new["wheels"], "bases": new_bases, "originals": originals,
                     "deleted": sorted(r["path"] for r in waiting
                                       if r["result"] == "deleted-upstream"),
                     "overlay": sorted(files), "lock": LOCK.read_text()}
            write_atomic(PENDING, (json.dumps(state, indent=1) + "\n").encode())
        else:
            update_lock(lock, key, to, new["sdist"], new["wheels"], new_bases)
            report["lock_updated"] = True

    print(f"rebase {up['package']} {up['version']} -> {to}{' (dry run)' if dry_run else ''}")
    for r in results:  # every overlay file, the other upstream's too
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
        deleted = [r["path"] for r in waiting if r["result"] == "deleted-upstream"]
        if any(r["result"] == "conflict" for r in waiting):
            print("conflicts written with markers: resolve them")
        if deleted:
            print(f"deleted upstream: {', '.join(deleted)}: move each change to where its "
                  f"mechanism lives now, then remove the overlay file")
        print("then `python build.py rebase --continue` (or --abort)")
    if report_path:
        write_atomic(report_path, (json.dumps(report, indent=1) + "\n").encode())
    return 0 if not blocking else EXIT_REBASE


def pin_new(lock: dict, key: str, package: str, to: str, *, dry_run: bool,
            report_path: Path | None) -> int:
    """First pin of a second upstream (no overlay files of it exist yet)."""
    if to == "latest":
        to = latest_version(package)
    new = release_files(package, to, sorted(lock["upstream"]["wheels"]))
    platform = DEFAULT_PLATFORM if DEFAULT_PLATFORM in new["wheels"] else sorted(new["wheels"])[0]
    fetch(package, **new["wheels"][platform])
    fetch(package, **new["sdist"])
    report = {"package": package, "from": None, "to": to, "wheel": new["wheels"][platform],
              "sdist": new["sdist"], "files": [], "clean": True, "lock_updated": False,
              "dry_run": dry_run}
    if not dry_run:
        lock[key] = {"package": package, "version": to}
        update_lock(lock, key, to, new["sdist"], new["wheels"], {})
        report["lock_updated"] = True
    print(f"rebase {package}: not pinned -> {to}{' (dry run)' if dry_run else ''}")
    print(f"lock {'updated' if report['lock_updated'] else 'not updated'}; its overlay files go "
          f"under vllm_overlay/{module_name(package)}/")
    if report_path:
        write_atomic(report_path, (json.dumps(report, indent=1) + "\n").encode())
    return 0


PENDING = ROOT / "rebase-pending.json"


def update_lock(lock: dict, key: str, to: str, sdist: dict, wheels: dict, bases: dict,
                dropped: tuple[str, ...] = ()) -> None:
    lock[key].update(version=to, sdist=sdist, wheels=wheels)
    for rel, sha in bases.items():
        if rel in lock["overlay"]:
            lock["overlay"][rel]["base_sha256"] = sha
    for rel in dropped:
        lock["overlay"].pop(rel, None)
    write_atomic(LOCK, dump_lock(lock).encode())


def resume(*, abort: bool) -> int:
    """--continue: conflicts resolved and deleted files' changes moved: move the pin;
    --abort: restore the overlay files (and put back any the maintainer removed)."""
    if not PENDING.exists():
        raise BuildError("no rebase in progress", EXIT_REBASE)
    state = json.loads(PENDING.read_text())
    lock = load_lock()
    files = overlay_files(lock)
    if abort:
        for rel, text in state["originals"].items():
            path = OVERLAY / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text.encode())
        write_atomic(LOCK, state["lock"].encode())
        PENDING.unlink()
        log(f"[rebase] aborted; {len(state['originals'])} overlay files and the lock restored")
        return 0
    left = [rel for rel in state["bases"]
            if rel in files and CONFLICT_RE.search(files[rel].read_text())]
    if left:
        raise BuildError("unresolved conflict markers in: " + ", ".join(left), EXIT_REBASE)
    kept = [rel for rel in state["deleted"] if rel in files]
    if kept:
        raise BuildError(
            "deleted upstream, still in the overlay: " + ", ".join(kept) + " (move the change "
            "to where its mechanism lives now and remove the file)", EXIT_REBASE)
    key = state["key"]
    mine = [rel for rel in lock["overlay"] if pin_of(lock, rel) == key]
    dropped = tuple(sorted(rel for rel in mine if rel not in files))
    added = sorted(rel for rel in files if rel not in lock["overlay"])
    update_lock(lock, key, state["to"], state["sdist"], state["wheels"],
                {rel: sha for rel, sha in state["bases"].items() if rel not in dropped},
                dropped)
    PENDING.unlink()
    for rel in dropped:
        log(f"[rebase] no longer in the overlay: {rel} (lock entry removed)")
    for rel in added:
        log(f"[rebase] not in upstream.lock yet: {rel} (`build.py check` names its entry)")
    log(f"[rebase] upstream.lock now pins {state['package']} {state['to']}; run "
        f"`python build.py check`")
    return 0


def toml_str(value: str) -> str:
    return json.dumps(value)  # TOML basic strings share JSON's escapes for what we store


def dump_pin(out: list[str], key: str, pin: dict, label: str | None = None) -> None:
    out += [f"[{key}]", f"package = {toml_str(pin['package'])}",
            f"version = {toml_str(pin['version'])}"]
    if label is not None:
        out += ["# PEP 440 local label: the overlay wheels are <version>+<label>.<overlay digest>",
                f"label = {toml_str(label)}"]
    out += ["", f"[{key}.sdist]", f"filename = {toml_str(pin['sdist']['filename'])}",
            f"sha256 = {toml_str(pin['sdist']['sha256'])}"]
    for plat, wheel in sorted(pin["wheels"].items()):
        out += ["", f"[{key}.wheels.{plat}]", f"filename = {toml_str(wheel['filename'])}",
                f"sha256 = {toml_str(wheel['sha256'])}"]


def dump_lock(lock: dict) -> str:
    out = [
        "# The pinned upstream releases and the base of every overlay file.",
        "# `python build.py check` verifies this file against vllm_overlay/ and the pinned wheels;",
        "# `python build.py rebase [--package P] --to X.Y.Z` rewrites it.",
        "# Hashes are sha256 of the files on the package index.",
        "",
    ]
    dump_pin(out, "upstream", lock["upstream"], lock["upstream"]["label"])
    if "plugin" in lock:
        out += ["", "# vLLM's GGUF support (out of tree since vLLM 0.24): its overlay files live "
                "under", "# vllm_overlay/<its package>/; the two overlay wheels require each "
                "other exactly."]
        dump_pin(out, "plugin", lock["plugin"])
    out += ["", "# Requirements of the vLLM overlay wheel that differ from upstream's METADATA "
            "(by project name).", "[requires]"]
    out += [f"{k} = {toml_str(v)}" for k, v in sorted(lock["requires"].items())]
    out += ["", "# Overlay files, by their path in their upstream's wheel. A file that replaces an"
            " upstream file records", "# the sha256 of the upstream file it was made from "
            "(base_sha256); a file upstream does not have is new = true."]
    for rel, entry in sorted(lock["overlay"].items()):
        out += ["", f"[overlay.{toml_str(rel)}]"]
        out += ["new = true"] if entry.get("new") is True else \
            [f"base_sha256 = {toml_str(entry['base_sha256'])}"]
    return "\n".join(out) + "\n"
