"""The docs' links and the result paths code quotes still resolve after results left the tree (issue 53):
every relative link in README.md and docs/**/*.md names a file that exists and, with `#anchor`, a heading
of that file; every `docs/perf/...` path quoted in tests/, e2e/ and engine/ exists (globs match); every
citation of PERF.md or the history by a section's title ('PERF.md, "Defaults"') or by a session's
ordinal ('HISTORY.md, nineteenth session') names a heading of that file."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
CITED_SECTION = re.compile(r'(PERF|HISTORY)\.md,?\s+"([^"]+)"|HISTORY\.md,?\s+([a-z-]+(?:th|st|nd|rd))\s+session')
QUOTED_RESULT = re.compile(r"docs/perf/[A-Za-z0-9_.*?/{},-]*[A-Za-z0-9_*}/-]")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans: links are not parsed there."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def anchors(md: Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(md.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(md: Path) -> list[str]:
    bad = []
    for m in LINK.finditer(prose(md.read_text(encoding="utf-8"))):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto: are not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        where = f"{md.relative_to(ROOT)}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    return bad


def quoted_result_paths() -> dict[str, set[str]]:
    quoted: dict[str, set[str]] = {}
    for top in ("tests", "e2e", "engine"):
        for f in sorted((ROOT / top).rglob("*")):
            if f.suffix not in {".py", ".sh", ".md", ".txt"} or not f.is_file():
                continue
            for p in QUOTED_RESULT.findall(f.read_text(encoding="utf-8", errors="replace")):
                quoted.setdefault(p, set()).add(str(f.relative_to(ROOT)))
    return quoted


def resolves(quoted: str) -> bool:
    alternatives = [quoted]
    m = re.search(r"\{([^{}]*)\}", quoted)
    if m:   # shell brace expansion: every alternative must exist
        alternatives = [quoted[:m.start()] + alt + quoted[m.end():] for alt in m.group(1).split(",")]
    return all(any(ROOT.glob(a)) if any(c in a for c in "*?") else (ROOT / a).exists() for a in alternatives)


def test_every_relative_doc_link_resolves():
    files = markdown_files()
    assert any(LINK.search(prose(f.read_text(encoding="utf-8"))) for f in files), "no links found: the parser is broken"
    bad = [b for f in files for b in broken_links(f)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_every_results_path_quoted_in_code_exists():
    quoted = quoted_result_paths()
    assert "e2e/rank_sim.py" in quoted.get("docs/perf/one-stack/small-x2", ()), "rank_sim's runs folder not found: the scan is broken"
    missing = {p: sorted(w) for p, w in quoted.items() if not resolves(p)}
    assert not missing, "quoted paths under docs/perf that do not exist: " + repr(missing)


def headings(md: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*$", prose(md.read_text(encoding="utf-8")), re.M)]


def test_every_cited_perf_section_exists():
    titles = {"PERF": headings(ROOT / "docs" / "PERF.md"), "HISTORY": headings(ROOT / "docs" / "perf" / "HISTORY.md")}
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    sources += [f for top in ("engine", "e2e", "tests") for f in (ROOT / top).rglob("*") if f.suffix in {".py", ".sh"}]
    cited, bad = 0, []
    for f in sources:
        for m in CITED_SECTION.finditer(re.sub(r"\s*\n\s*#?\s*", " ", f.read_text(encoding="utf-8"))):
            doc, title, ordinal = m.group(1) or "HISTORY", m.group(2), m.group(3)
            cited += 1
            ok = (any(t.startswith(title) for t in titles[doc]) if title
                  else any(f"{ordinal} session)" in t or f"{ordinal} session," in t for t in titles[doc]))
            if not ok:
                bad.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert cited >= 10, f"only {cited} citations found: the scan is broken"
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(bad)
