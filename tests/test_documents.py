"""engine/data/documents.py: real documents written on the fly (a PDF by fpdf2, a .docx by
python-docx, an HTML page, Markdown, reStructuredText) read as text with their structure,
cut into chunks that keep their source, duplicates dropped, held out by document, and every
bad file named in one line while the rest of the folder is read."""

from __future__ import annotations

import os
import tracemalloc
import unicodedata

import pytest

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.settings import DataSettings

from edgetune.engine.data import documents as docs
from edgetune.engine.data import files

from edgetune.engine import data as D


@pytest.fixture(scope="module")
def tok():
    from edgetune.engine.models.model import embedded_model_dir, load_tokenizer

    return load_tokenizer(str(embedded_model_dir()))


def write_pdf(path, pages: list[list[str]], header: str = "", numbers: bool = False) -> None:
    """A PDF of text pages, each line at its own height; a running header and page numbers
    at the bottom when asked for."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_auto_page_break(False)
    for n, lines in enumerate(pages, start=1):
        pdf.add_page()
        pdf.set_font("helvetica", size=11)
        if header:
            pdf.text(20, 12, header)
        for i, line in enumerate(lines):
            pdf.text(20, 40 + 10 * i, line)
        if numbers:
            pdf.text(100, 285, f"Page {n} of {len(pages)}")
    pdf.output(str(path))


def write_docx(path) -> None:
    import docx

    d = docx.Document()
    d.add_heading("Installing the pump", 1)
    d.add_paragraph("Unpack the box and keep the foam.")
    d.add_paragraph("Tighten bolt A first.", style="List Bullet")
    table = d.add_table(rows=2, cols=2)
    for r, row in enumerate([("part", "torque"), ("bolt A", "12 Nm")]):
        for c, text in enumerate(row):
            table.cell(r, c).text = text
    d.add_heading("Daily use", 2)
    d.add_paragraph("Press the red button twice to start.")
    d.save(str(path))


PAGE = """<!DOCTYPE html><html><head><title>Lever guide</title><style>p {color: red}</style>
<script>var tracking = 1;</script></head><body>
<nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<header>Site banner</header>
<h1>The blue lever</h1><p>The   <b>blue</b> lever<br>is on the left.</p><!-- a comment -->
<ul><li>pull gently</li><li>never twice</li></ul>
<h2>Cleaning</h2><p>Wipe it with a dry cloth.</p>
<footer>(c) ACME, all rights reserved</footer></body></html>"""


def uploaded_documents(src):
    """A folder of what a user uploads together: a PDF, a scanned PDF with no text layer, a
    .docx and an HTML page."""
    src.mkdir()
    write_pdf(src / "manual.pdf", [["The pump has three valves and one red lever."], ["Valve two opens at 9 bar."]])
    write_pdf(src / "scan.pdf", [[]])
    write_docx(src / "guide.docx")
    (src / "page.html").write_text(PAGE)
    return src


def read(path, name=None):
    return docs.extract(name or path.name, path, 64 << 20)


# --------------------------------------------------------------------------- extraction


def test_pdf_pages_without_headers_and_page_numbers(tmp_path):
    pages = [[f"Chapter {i}: the pump has {3 * i} valves.", f"Valve Z{i} opens at {7 * i} bar."] for i in range(1, 5)]
    write_pdf(tmp_path / "manual.pdf", pages, header="ACME Pump Manual - Confidential", numbers=True)
    doc = read(tmp_path / "manual.pdf")
    assert not doc.problem and doc.pages == 4
    assert [p.where for p in doc.parts] == ["page 1", "page 2", "page 3", "page 4"]
    assert doc.parts[1].text == "Chapter 2: the pump has 6 valves.\nValve Z2 opens at 14 bar."
    text = "\n".join(p.text for p in doc.parts)
    assert "ACME" not in text and "Page" not in text
    assert doc.notes == ["8 header, footer and page-number lines dropped"]
    assert doc.chars == len(text) - 3  # the parts' own text; pages are joined by blank lines in the chunks


def test_a_line_repeated_inside_pages_is_kept():
    pages = [f"Running head\nbody {i}\nThe same sentence in the middle.\nmore {i}\nclosing {w}" for i, w in enumerate("abcd")]
    kept, dropped = docs.drop_boilerplate(pages)
    assert dropped == 4 and all("Running head" not in p and "The same sentence" in p for p in kept)
    two = ["head\nbody one", "head\nbody two"]
    assert docs.drop_boilerplate(two) == (two, 0)  # two pages are too few to tell


def test_docx_headings_lists_and_tables_in_order(tmp_path):
    write_docx(tmp_path / "guide.docx")
    doc = read(tmp_path / "guide.docx")
    assert [p.where for p in doc.parts] == ["Installing the pump", "Daily use"]
    assert doc.parts[0].text == ("# Installing the pump\n\nUnpack the box and keep the foam.\n\n- Tighten bolt A first."
                                 "\n\npart | torque\n\nbolt A | 12 Nm")
    assert doc.parts[1].text == "## Daily use\n\nPress the red button twice to start."


def test_html_text_by_blocks_without_scripts_navigation_or_footers(tmp_path):
    (tmp_path / "page.html").write_text(PAGE)
    doc = read(tmp_path / "page.html")
    assert [p.where for p in doc.parts] == ["The blue lever", "Cleaning"]
    assert doc.parts[0].text == "# The blue lever\n\nThe blue lever\nis on the left.\n\n- pull gently\n- never twice"
    assert doc.parts[1].text == "## Cleaning\n\nWipe it with a dry cloth."
    joined = " ".join(p.text for p in doc.parts)
    for gone in ("tracking", "Home", "banner", "ACME", "color", "comment", "Lever guide"):
        assert gone not in joined


def test_markdown_and_rst_sections_and_unicode_normalised(tmp_path):
    decomposed = "cafe\u0301"
    (tmp_path / "notes.md").write_text(f"Intro {decomposed}.\r\n\n\n\n# Setup\n\n```\n# not a heading\n```\n"
                                       "## Use it\n\nText.\x07\n")
    doc = read(tmp_path / "notes.md")
    assert [p.where for p in doc.parts] == ["line 1", "Setup", "Use it"]
    assert doc.parts[0].text == "Intro caf\u00e9." and unicodedata.is_normalized("NFC", doc.parts[0].text)
    assert doc.parts[1].text == "# Setup\n\n```\n# not a heading\n```"
    assert doc.parts[2].text == "## Use it\n\nText."
    (tmp_path / "guide.rst").write_text("Guide\n=====\n\nFirst.\n\nDetails\n-------\n\nSecond.\n")
    doc = read(tmp_path / "guide.rst")
    assert [(p.where, p.text) for p in doc.parts] == [("Guide", "Guide\n=====\n\nFirst."),
                                                       ("Details", "Details\n-------\n\nSecond.")]


# --------------------------------------------------------------------------- chunks


def test_chunks_overlap_as_context_and_each_token_is_a_target_once():
    ids = list(range(100, 137))  # 37 tokens
    chunks = docs.chunk_tokens(ids, 10, 3)
    assert all(len(window) == 10 for _, window, _ in chunks)  # the last one starts early enough to be whole
    targets = [t for _, _, labels in chunks for t in labels if t != D.IGNORE]
    assert targets == ids
    for (s0, w0, _), (s1, w1, labels) in zip(chunks, chunks[1:]):
        seen = sum(x == D.IGNORE for x in labels)
        assert seen >= 3 and w1[:seen] == ids[s1 : s1 + seen] and s1 + seen == s0 + len(w0)
    assert [labels for _, _, labels in docs.chunk_tokens(ids[:5], 10, 3)] == [ids[:5]]


def test_a_folder_becomes_chunks_that_keep_their_source(tok, tmp_path):
    write_pdf(tmp_path / "manual.pdf", [[f"Pump model {i} has {i + 2} valves and a {c} handle." for c in ("red", "green")]
                                        for i in range(1, 4)])
    write_docx(tmp_path / "guide.docx")
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "page.htm").write_text(PAGE)
    ds = DataSettings(path=str(tmp_path), max_seq_len=24, chunk_overlap=4, eval_fraction=0.0)
    data = D.load_sft(ds, tok, seed=0)
    r = data.report
    assert r.format == "documents" and r.eval_rows == 0 and r.train_rows == len(data.train) == r.rows_kept
    by_file = {e["file"]: e for e in r.documents}
    assert set(by_file) == {"guide.docx", "manual.pdf", "web/page.htm"}
    assert by_file["manual.pdf"]["pages"] == 3 and by_file["web/page.htm"]["split"] == "train"
    for name in by_file:
        mine = [c for c in data.train if c.file == name]
        assert len(mine) == by_file[name]["chunks"] > 1
        assert all(len(c.input_ids) <= 24 for c in mine)
        # the targets, in order, are the whole document: its parts joined by blank lines
        doc = read(tmp_path / name, name)
        assert by_file[name]["chars"] == sum(len(p.text) for p in doc.parts)
        text = tok.decode([t for c in mine for t in c.labels if t != D.IGNORE], skip_special_tokens=True)
        assert text == "\n\n".join(p.text for p in doc.parts)
        assert mine[-1].input_ids[-1] == tok.eos_token_id
    pdf = [c for c in data.train if c.file == "manual.pdf"]
    assert [c.where for c in pdf][0] == "page 1" and pdf[-1].where == "page 3"
    assert "Pump model 3" in tok.decode(pdf[-1].input_ids)
    guide = tok.decode([t for c in data.train if c.file == "guide.docx" for t in c.labels if t != D.IGNORE],
                       skip_special_tokens=True)
    assert guide == ("# Installing the pump\n\nUnpack the box and keep the foam.\n\n- Tighten bolt A first.\n\n"
                     "part | torque\n\nbolt A | 12 Nm\n\n## Daily use\n\nPress the red button twice to start.")
    summary = r.summary()
    assert f"{len(data.train)} of {len(data.train)} chunks kept" in summary and "web/page.htm" in summary
    preview = docs.preview_chunks(data, tok, 3)
    assert [p["file"] for p in preview] == ["guide.docx"] * 3 and preview[0]["text"].startswith("# Installing")


def test_exact_and_near_duplicates_are_dropped_and_counted(tok, tmp_path):
    text = " ".join(f"The pump of model {n} needs oil every {n + 3} days and a new filter every {n + 1} months"
                    f" while valve {n} stays closed." for n in range(1, 6)) + " Then dry the housing after cleaning."
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text(text.upper().replace(" ", "  "))  # the same after normalising
    (tmp_path / "c.txt").write_text(text.replace("cleaning", "washing"))  # one word of a hundred changed
    (tmp_path / "d.txt").write_text("A different note about the garden hose and its green tap, kept as it is.")
    data = D.load_sft(DataSettings(path=str(tmp_path), max_seq_len=512, eval_fraction=0.0), tok, seed=0)
    r = data.report
    assert r.dropped == {docs.DROP_EXACT: 1, docs.DROP_NEAR: 1} and r.rows_total == 4 and r.rows_kept == 2
    assert sorted(c.file for c in data.train) == ["a.txt", "d.txt"]
    assert {e["file"]: e["dropped"] for e in r.documents}["c.txt"] == {docs.DROP_NEAR: 1}


def test_held_out_split_is_by_document_and_never_trains_on_held_out_text(tok, tmp_path):
    for i in range(10):
        (tmp_path / f"note{i}.md").write_text(f"# Note {i}\n\n" + " ".join(f"word{i}x{j}" for j in range(60)))
    (tmp_path / "copy.md").write_text((tmp_path / "note3.md").read_text())
    ds = DataSettings(path=str(tmp_path), max_seq_len=32, eval_fraction=0.3)
    data = D.load_sft(ds, tok, seed=0)
    train_files, eval_files = {c.file for c in data.train}, {c.file for c in data.eval}
    assert eval_files and not train_files & eval_files
    split = {e["file"]: e["split"] for e in data.report.documents}
    assert {f for f, s in split.items() if s == "held out"} >= eval_files
    train_text = {tuple(c.input_ids) for c in data.train}
    assert not any(tuple(c.input_ids) in train_text for c in data.eval)
    if "copy.md" in eval_files or "note3.md" in eval_files:  # one of the twins held out: its chunks went
        assert data.report.dropped.get(docs.DROP_HELD_OUT)
    again = D.load_sft(ds, tok, seed=0)
    assert [c.file for c in again.eval] == [c.file for c in data.eval]  # the same seed, the same split
    other = D.load_sft(DataSettings(path=str(tmp_path), max_seq_len=32, eval_fraction=0.3), tok, seed=1)
    assert {c.file for c in other.eval} != eval_files


def test_include_and_exclude_globs(tok, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "pump.py").write_text("def pressure(bar):\n    return bar * 14.5  # psi per bar\n")
    (tmp_path / "src" / "skip.py").write_text("print('not this one, it is excluded by its name')\n")
    (tmp_path / "README.md").write_text("# Pump tools\n\nHelpers that convert pressure units for the pump.\n")
    (tmp_path / "drafts").mkdir()
    (tmp_path / "drafts" / "old.md").write_text("# Old\n\nAn old draft of the pump tools readme text.\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "notes.txt").write_text("internal notes of version control, never read\n")
    ds = DataSettings(path=str(tmp_path), include="*.py", exclude="drafts, skip.py", eval_fraction=0.0)
    r = D.load_sft(ds, tok, seed=0).report
    assert [e["file"] for e in r.documents] == ["README.md", "src/pump.py"]
    assert "1 hidden files and folders not read" in r.notes
    assert D.is_documents(str(tmp_path / "src" / "pump.py"), "*.py")
    assert not D.is_documents(str(tmp_path / "src" / "pump.py"))


# --------------------------------------------------------------------------- bad input


def test_every_bad_file_is_named_in_one_line_and_the_rest_is_read(tok, tmp_path):
    from pypdf import PdfWriter

    good = "Valve Z9 opens at ninety bar and closes again at forty bar after a minute."
    write_pdf(tmp_path / "good.pdf", [[good]])
    locked = PdfWriter(clone_from=str(tmp_path / "good.pdf"))
    locked.encrypt("secret", algorithm="RC4-128")
    locked.write(str(tmp_path / "locked.pdf"))
    (tmp_path / "damaged.pdf").write_bytes((tmp_path / "good.pdf").read_bytes()[:300])
    write_pdf(tmp_path / "scan.pdf", [[], []])  # pages with no text layer
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "photo.txt").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "latin.txt").write_bytes("Caf\u00e9 cr\u00e8me is served at the pump station every morning.".encode("cp1252"))
    (tmp_path / "gb.txt").write_bytes("\u6cf5\u7684\u8bf4\u660e\u4e66\u3002".encode("gb18030") * 20)
    (tmp_path / "broken.docx").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "sub").mkdir()
    os.symlink("..", tmp_path / "sub" / "loop")
    os.symlink(tmp_path / "gone.md", tmp_path / "dangling.md")
    data = D.load_sft(DataSettings(path=str(tmp_path), eval_fraction=0.0), tok, seed=0)
    problems = {e["file"]: e["problem"] for e in data.report.documents if e["problem"]}
    assert problems == {
        "locked.pdf": "an encrypted PDF (it needs a password): save a decrypted copy to read it",
        "damaged.pdf": problems["damaged.pdf"],
        "scan.pdf": docs.NEEDS_OCR,
        "empty.txt": "an empty file (0 bytes)",
        "photo.txt": "binary data, not text (NUL or control bytes): not read",
        "gb.txt": problems["gb.txt"],
        "broken.docx": problems["broken.docx"],
        "sub/loop": "a symlink loop (leads back to a folder already read)",
        "dangling.md": "a broken symlink (its target is missing)",
    }
    assert problems["damaged.pdf"].startswith("a damaged PDF: pypdf cannot read it (")
    assert problems["broken.docx"].startswith("a damaged Word file")
    assert problems["gb.txt"].startswith("not UTF-8 (byte 0x") and "save it as UTF-8" in problems["gb.txt"]
    assert all("\n" not in p for p in problems.values())
    read_ok = {e["file"]: e for e in data.report.documents if not e["problem"]}
    assert set(read_ok) == {"good.pdf", "latin.txt"}
    assert read_ok["latin.txt"]["notes"] == ["not UTF-8 (byte 0xe9 near offset 3): read as Windows-1252"]
    text = tok.decode([t for c in data.train for t in c.input_ids], skip_special_tokens=True)
    assert good in text and "Caf\u00e9 cr\u00e8me" in text
    summary = data.report.summary()
    assert "scan.pdf" in summary and "needs OCR" in summary


def test_nothing_readable_is_one_line(tok, tmp_path):
    with pytest.raises(DataError, match=r"manual\.pdf: file not found"):
        D.load_sft(DataSettings(path=str(tmp_path / "manual.pdf")), tok, seed=0)
    with pytest.raises(DataError, match="no documents found") as e:
        D.load_sft(DataSettings(path=str(tmp_path)), tok, seed=0)
    (tmp_path / "empty.md").write_bytes(b"")
    with pytest.raises(DataError, match=r"no chunks left to train on: 0 documents read, 1 not \(first: empty.md: an "
                                        r"empty file") as e:
        D.load_sft(DataSettings(path=str(tmp_path)), tok, seed=0)
    assert "\n" not in str(e.value)
    (tmp_path / "notes.md").write_text("# Notes\n\nSome notes about the pump and its valves.\n")
    with pytest.raises(DataError, match="chunk_overlap"):
        D.load_sft(DataSettings(path=str(tmp_path), max_seq_len=16, chunk_overlap=16), tok, seed=0)
    with pytest.raises(DataError, match="SFT only"):
        D.load_rl(DataSettings(path=str(tmp_path / "notes.md")), 0)


def test_a_long_file_is_read_in_blocks_and_cut_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(docs, "BLOCK_BYTES", 64 << 10)
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        for i in range(80_000):
            f.write(f"Line {i} of a long manual about valves and pumps.\n" + ("\n" if i % 7 == 0 else ""))
    size = big.stat().st_size
    assert size > 4_000_000
    tracemalloc.start()
    try:
        doc = docs.extract("big.txt", big, 256 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 4  # bounded by the limit, not by the file
    assert doc.notes == ["cut at 0.25 MiB (data.max_doc_mb)"]
    text = "\n\n".join(p.text for p in doc.parts)
    assert 250 << 10 < len(text) <= 256 << 10
    assert text.startswith("Line 0 of") and f"Line {text.count('Line') - 2} of a long manual" in text
    assert [p.where for p in doc.parts[:2]] == ["line 1", f"line {doc.parts[0].text.count(chr(10)) + 3}"]
    write_pdf(tmp_path / "big.pdf", [["x" * 50]] * 3)
    pdf_size = (tmp_path / "big.pdf").stat().st_size
    assert docs.extract("big.pdf", tmp_path / "big.pdf", 1 << 10).problem == (
        f"larger than {1 / 1024:g} MiB ({pdf_size / 2**20:.3g} MiB): not read; raise data.max_doc_mb or split it")


def test_a_folder_of_many_files_reports_its_progress(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(files, "PROGRESS_EVERY_S", 0.0)
    for i in range(300):
        (tmp_path / f"n{i:03d}.txt").write_text(f"Note {i}: the pump number {i} was serviced on day {i % 28}.")
    heard = []
    data = D.load_sft(DataSettings(path=str(tmp_path), eval_fraction=0.0), tok, 0,
                      lambda rows, read, total: heard.append((rows, read, total)))
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert len(heard) >= 300 and heard[-1] == (len(data.train), total, total)
    assert [h[1] for h in heard] == sorted(h[1] for h in heard)
    assert len(data.report.documents) == 300
    few = D.load_sft(DataSettings(path=str(tmp_path), eval_fraction=0.0, max_rows=10), tok, 0)
    assert len(few.train) == 10 and few.report.notes == ["stopped after 10 chunks (data.max_rows); 290 files not read"]


def test_cli_data_prints_each_file(tmp_path, capsys):
    from edgetune.engine import cli

    write_pdf(tmp_path / "manual.pdf", [["The pump has three valves and one red lever."]])
    write_pdf(tmp_path / "scan.pdf", [[]])
    assert cli.main(["data", str(tmp_path), "--max-seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "(documents): 1 of 1 chunks kept" in out
    row = [line.split() for line in out.splitlines() if "manual.pdf" in line]
    assert row[0][:4] == ["manual.pdf", "1", "44", "1"] and row[0][5] == "train"  # pages, chars, chunks
    assert [line.strip() for line in out.splitlines() if "scan.pdf" in line] == [
        f"scan.pdf        1          0       0         0  {docs.NEEDS_OCR}"]


# --------------------------------------------------------------------------- the app's Data tab


def test_the_data_tab_keeps_uploaded_documents_together_and_shows_each_file(tmp_path):
    from edgetune.engine.core import settings as S

    from edgetune.engine.run.checks import check_data

    from edgetune.app import panels
    from edgetune.app.ui import build_app

    src = uploaded_documents(tmp_path / "mine")
    demo = build_app(tmp_path / "runs")
    try:
        page = demo.edgetune_page
        tab, path_box = page.data_tab, page.fields["data.path"]
        uploaded = sorted(str(p) for p in src.iterdir())
        folder = tab.take_upload(uploaded)[path_box]
        assert folder == str(page.uploads / "documents")
        assert sorted(p.name for p in page.uploads.joinpath("documents").iterdir()) == sorted(p.name for p in src.iterdir())
        assert tab.take_upload(uploaded[:1])[path_box] == str(page.uploads / "documents-2")  # never into the first
        assert tab.drop_upload(folder)[path_box] == ""
    finally:
        demo.edgetune_chat.close()
    result = check_data(S.resolve(preset="sft-quickstart", overrides={"data": {"path": folder, "eval_fraction": 0.0,
                                                                               "max_seq_len": 32}}))
    assert result["ok"] and result["format"] == "documents"
    report = panels.data_report_markdown(result)
    assert f"{result['report']['rows_kept']} of {result['report']['rows_total']} chunks kept" in report
    assert "| manual.pdf | 2 | 69 | 1 | 21 | train |" in report and "| scan.pdf | 1 | 0 | 0 | 0 | **no text layer" in report
    frame = panels.preview_frame(result)
    assert list(frame.columns) == ["row", "file", "where", "split", "tokens", "text"]
    assert frame.iloc[0]["file"] == "guide.docx" and frame.iloc[0]["text"].startswith("# Installing the pump")
    assert set(frame["file"]) == {"guide.docx", "manual.pdf", "page.html"}


# --------------------------------------------------------------------------- did it learn them

PARTS = ["flimmer valve", "quandle shaft", "brask gasket", "overt spindle", "nolly coupling"]


def manual_folder(folder, n: int = 16) -> None:
    """Service manuals of invented pumps, one per file, as PDF, Word, HTML and Markdown: the
    same invented words and the same way of saying things in every one, so the held-out
    manuals can be learned from the others."""
    folder.mkdir()
    for i in range(n):
        name = f"Zorbex-{100 + 7 * i}"
        lines = [f"The {name} pump is serviced every {3 + i % 5} weeks."]
        for j, part in enumerate(PARTS):
            k = (i + j) % len(PARTS)
            lines.append(f"Check the {part} of the {name}: it wears after {20 + 5 * k} hours, replace it with "
                         f"a {PARTS[(j + 1) % len(PARTS)]} from the blue kit.")
        lines.append(f"Never run the {name} dry; the {PARTS[i % len(PARTS)]} cracks.")
        kind = ("pdf", "docx", "html", "md")[i % 4]
        if kind == "pdf":
            write_pdf(folder / f"{name}.pdf", [lines[:4], lines[4:]])
        elif kind == "docx":
            import docx

            d = docx.Document()
            d.add_heading(f"{name} service manual", 1)
            for line in lines:
                d.add_paragraph(line)
            d.save(str(folder / f"{name}.docx"))
        elif kind == "html":
            body = "".join(f"<p>{line}</p>" for line in lines)
            (folder / f"{name}.html").write_text(f"<html><body><h1>{name} service manual</h1>{body}</body></html>")
        else:
            (folder / f"{name}.md").write_text(f"# {name} service manual\n\n" + "\n\n".join(lines) + "\n")


@pytest.mark.slow
def test_cpt_docs_lowers_the_held_out_documents_loss(tmp_path):
    """The cpt-docs preset, quick-start sized, on a folder of manuals: the held-out manuals'
    loss under the adapter against the base, chunk by chunk, drops with its interval below 0."""
    from inline_run import run_inline

    from edgetune.engine.core import settings as S

    from edgetune.engine.methods.sft.sft import train

    manual_folder(tmp_path / "manuals")
    cfg = S.resolve(preset="cpt-docs", overrides=[
        f"data.path={tmp_path / 'manuals'}", "data.max_seq_len=96", "data.chunk_overlap=16",
        "data.eval_fraction=0.25", "sft.steps=30", "sft.batch_size=4", "sft.eval_every=30", "sft.warmup_steps=3",
        "sft.lr=1e-3", "sft.samples=0", f"run.runs_dir={tmp_path / 'runs'}", "run.checkpoint_every=0"])
    _, _, events = run_inline(train, cfg, tmp_path / "runs" / "cpt")
    data = next(e for e in events if e["type"] == "data")["report"]
    held = {d["file"] for d in data["documents"] if d["split"] == "held out"}
    assert len(held) == 4 and data["eval_rows"] >= 4
    [c] = [e for e in events if e["type"] == "comparison"]
    assert (c["a"], c["b"], c["metric"]) == ("the base", "the adapter", "loss")
    assert c["difference"] < 0 and c["high"] < 0, c  # the adapter's loss is lower, the interval all below 0
    assert events[-1]["type"] == "finished"
