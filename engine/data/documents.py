"""Documents as training rows: a folder (or one file) of .txt, .md, .rst, .pdf, .docx,
.html / .htm and any files `data.include` names, read as text and cut into token chunks
that train like `text` rows (every token a target).

Reading (one file at a time, so memory stays bounded by the largest file, itself bounded by
`data.max_doc_mb`):

    .txt .md .rst, data.include   read in blocks; UTF-8 (a byte-order mark, UTF-16 with one),
                                  else Windows-1252 when the bytes are that, said in the report;
                                  a file longer than max_doc_mb is cut there
    .pdf                          pypdf, page by page; lines repeated at the top or bottom of
                                  most pages (running headers, footers) and page numbers dropped
    .docx                         python-docx: paragraphs and tables in order, headings as "# ..."
    .html .htm                    lxml: the text of the page's blocks, headings as "# ...",
                                  list items as "- ", without scripts, styles, navigation,
                                  headers and footers

Each text is cut into parts that know where they are ("page 3", a heading, "line 120"),
Unicode-normalised (NFC), control characters dropped, blank runs collapsed. A file that
gives no text is named with why (a PDF with no text layer: it needs OCR), and the rest of
the folder is still read. Hidden files and folders (".git") are not read.

Chunking: each document's tokens (the tokenizer's own start token, the text, an end token)
are cut into chunks of `data.max_seq_len` tokens; with `data.chunk_overlap` each chunk
repeats that many tokens from the end of the one before, as context only (they are not
targets again). A chunk records its file and where it starts, for the report.

Duplicates: chunks whose normalised text (case, punctuation, spacing ignored) was seen
before are dropped as exact duplicates; chunks whose 5-word shingles' MinHash estimate a
Jaccard similarity of NEAR_DUPLICATE or more with a kept chunk, near duplicates.
Deterministic: files in path order, fixed hash seeds.

Held-out split by document: `data.eval_fraction` of the documents (taken with the run's
seed) are held out whole; a held-out chunk that duplicates a training chunk is dropped, so
no held-out text is trained on. `data.eval_path` names other documents (or a row file) instead.
"""

from __future__ import annotations

import codecs
import fnmatch
import hashlib
import logging
import os
import re
import unicodedata
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.settings import DataSettings

from edgetune.engine.data import prompts
from edgetune.engine.data.files import (
    DOCUMENT_TYPES,
    Progress,
    ValidationReport,
    eval_source,
    is_documents,
    length_stats,
    resolve_data_path,
    split_rows,
)
from edgetune.engine.data.sft import IGNORE, SFTData, SFTExample, rows_and_format, tokenize_rows

FORMAT = "documents"  # the report's format for documents
KINDS = {".txt": "text", ".md": "markdown", ".markdown": "markdown", ".rst": "rst", ".pdf": "pdf",
         ".docx": "docx", ".html": "html", ".htm": "html"}
assert set(KINDS) == set(DOCUMENT_TYPES)
BLOCK_BYTES = 1 << 20  # a text file is read this much at a time
PART_CHARS = 16_000  # a part of a text ends at the first blank line past this many characters
MIN_CHUNK_TOKENS = 8  # a document of fewer tokens is left out (a stray title, a signature)
NEAR_DUPLICATE = 0.8  # estimated Jaccard similarity of two chunks' shingles that makes the later one a duplicate
SHINGLE_WORDS = 5
PERMUTATIONS, BANDS = 64, 16  # MinHash signature length; LSH bands of 4 values
MAX_LISTED = 2000  # files a report lists one by one (every file with a problem is listed)

DROP_EXACT = "exact duplicate of an earlier chunk"
DROP_NEAR = "near duplicate of an earlier chunk"
DROP_HELD_OUT = "held-out chunk that duplicates a training chunk"
NEEDS_OCR = "no text layer (a scanned PDF?): it needs OCR first, e.g. `ocrmypdf in.pdf out.pdf`"

logging.getLogger("pypdf").setLevel(logging.ERROR)  # its warnings about recoverable flaws are not the user's


@dataclass
class Part:
    where: str  # "page 3", a heading, "line 120"
    text: str


@dataclass
class Document:
    file: str  # as shown: relative to the folder read
    kind: str
    parts: list[Part] = field(default_factory=list)
    pages: int = 0
    problem: str = ""  # why nothing was read; "" = read
    notes: list[str] = field(default_factory=list)  # what was dropped or changed
    chars: int = 0  # of the extracted text


@dataclass
class Chunk(SFTExample):
    file: str = ""
    where: str = ""


# --------------------------------------------------------------------------- finding files


def globs(patterns: str) -> list[str]:
    return [g.strip() for g in patterns.split(",") if g.strip()]


def _matches(rel: str, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(name, g) for g in patterns)


def find_documents(path: str, ds: DataSettings) -> tuple[Path, list[tuple[str, Path]], list[Document], list[str]]:
    """(the folder, [(shown name, path)] of the files to read in path order, the files and
    folders that cannot be read, notes on what was passed over). `path` may be one file."""
    root = Path(path).expanduser()
    include, exclude = globs(ds.include), globs(ds.exclude)
    if root.is_file():
        return root.parent, [(root.name, root)], [], []
    found: list[tuple[str, Path]] = []
    problems: list[Document] = []
    other = hidden = 0
    seen = set()

    def walk_error(e: OSError) -> None:
        problems.append(Document(_rel(e.filename, root), "folder", problem=f"cannot list: {e.strerror}"))

    for folder, dirs, files in os.walk(root, onerror=walk_error, followlinks=True):
        here = Path(folder)
        try:
            st = here.stat()
        except OSError:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        keep = []
        for d in sorted(dirs):
            rel = _rel(here / d, root)
            if d.startswith("."):
                hidden += 1
                continue
            if _matches(rel, exclude) or _matches(rel + "/", exclude):
                continue
            try:
                key = ((s := (here / d).stat()).st_dev, s.st_ino)
            except OSError as e:
                problems.append(Document(rel, "folder", problem=f"cannot read: {e.strerror}"))
                continue
            if key in seen:
                problems.append(Document(rel, "folder", problem="a symlink loop (leads back to a folder already read)"))
                continue
            keep.append(d)
        dirs[:] = keep
        for f in sorted(files):
            rel = _rel(here / f, root)
            if f.startswith("."):
                hidden += 1
                continue
            if _matches(rel, exclude):
                continue
            if not (f.lower().endswith(DOCUMENT_TYPES) or _matches(rel, include)):
                other += 1
                continue
            if not (here / f).exists():
                problems.append(Document(rel, _kind(f), problem="a broken symlink (its target is missing)"))
                continue
            found.append((rel, here / f))
    notes = []
    if other:
        notes.append(f"{other} other files not read (not {', '.join(DOCUMENT_TYPES)}; data.include adds more)")
    if hidden:
        notes.append(f"{hidden} hidden files and folders not read")
    return root, sorted(found), problems, notes


def _rel(p, root: Path) -> str:
    try:
        return Path(p).relative_to(root).as_posix()
    except ValueError:
        return str(p)


def _kind(name: str) -> str:
    return KINDS.get(Path(name).suffix.lower(), "text")


# --------------------------------------------------------------------------- text


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f\u200b\ufeff]")
_BLANKS = re.compile(r"\n{3,}")


def clean(text: str) -> str:
    """NFC, newlines as \\n, form feeds as breaks, control characters dropped, trailing
    spaces stripped, runs of blank lines as one blank line."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n").replace("\x0c", "\n\n"))
    text = _CONTROL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip("\n")


def _encoding(path: Path, limit: int) -> tuple[str, str, str]:
    """(codec, note, problem) of a text file, read once in blocks: UTF-8 (with or without a
    byte-order mark), UTF-16 with one, else Windows-1252 if its bytes decode as that."""
    with open(path, "rb") as f:
        first = f.read(BLOCK_BYTES)
    if first.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16", "", ""
    controls = sum(first.count(bytes([c])) for c in (*range(0, 9), *range(14, 32)))
    if b"\x00" in first or controls > len(first) // 20:
        return "", "", "binary data, not text (NUL or control bytes): not read"
    bad = ""
    for codec in ("utf-8-sig", "cp1252"):
        dec, done = codecs.getincrementaldecoder(codec)(), 0
        try:
            with open(path, "rb") as f:
                while done < limit and (block := f.read(min(BLOCK_BYTES, limit - done))):
                    dec.decode(block, final=False)
                    done += len(block)
            if done < limit:
                dec.decode(b"", final=True)
        except UnicodeDecodeError as e:
            bad = bad or f"byte 0x{e.object[e.start]:02x} near offset {done + e.start}"
            continue
        if codec == "cp1252" and not _western(first.decode(codec, errors="replace")):
            break
        return codec, "" if codec == "utf-8-sig" else f"not UTF-8 ({bad}): read as Windows-1252", ""
    return "", "", f"not UTF-8 ({bad}) nor Windows-1252 text: save it as UTF-8 to read it"


def _western(text: str) -> bool:
    """Whether text decoded as Windows-1252 reads like it: its accented letters stand among
    plain ones ("café"), not in runs of three or more, as the bytes of an East Asian or
    Cyrillic legacy encoding decode."""
    high = sum(ch > "\x7f" for ch in text)
    runs = sum(len(m) for m in re.findall(r"[^\x00-\x7f]{3,}", text))
    return 2 * runs <= high


def _text_blocks(path: Path, codec: str, limit: int):
    """The file's text, decoded a block at a time, at most `limit` bytes of it."""
    dec = codecs.getincrementaldecoder(codec)()
    done = 0
    with open(path, "rb") as f:
        while done < limit and (block := f.read(min(BLOCK_BYTES, limit - done))):
            done += len(block)
            yield dec.decode(block, final=False)
    if done < limit:
        yield dec.decode(b"", final=True)


_MD_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(\S.*?)\s*#*\s*$")
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+:.<>_])\1{2,}\s*$")


def _text_parts(blocks, kind: str) -> list[Part]:
    """Lines into parts: a new part at each heading (Markdown "#", reStructuredText
    underlines) and at the first blank line past PART_CHARS characters."""
    parts: list[Part] = []
    lines: list[str] = []
    size, start, n, heading, fence = 0, 1, 0, "", False

    def flush(next_start: int) -> None:
        nonlocal lines, size, start
        text = clean("\n".join(lines))
        if text.strip():
            parts.append(Part(heading or f"line {start}", text))
        lines, size, start = [], 0, next_start

    rest = ""
    for block in [*blocks, None]:
        if block is None:
            todo, rest = rest.split("\n") if rest else [], ""
        else:
            todo = (rest + block).split("\n")
            rest = todo.pop()
        for line in todo:
            n += 1
            line = line.rstrip("\r")
            if kind == "markdown":
                fence = fence != line.lstrip().startswith(("```", "~~~"))
                m = None if fence else _MD_HEADING.match(line)
                if m:
                    flush(n)
                    heading = m.group(1)
            elif kind == "rst" and lines and _RST_UNDERLINE.match(line) and lines[-1].strip() \
                    and len(line.strip()) >= len(lines[-1].strip()) and not _RST_UNDERLINE.match(lines[-1]):
                title = lines.pop()
                flush(n - 1)
                heading = title.strip()
                lines.append(title)
            lines.append(line)
            size += len(line) + 1
            if size >= PART_CHARS and (not line.strip() or size >= 4 * PART_CHARS):
                flush(n + 1)
    flush(n + 1)
    return parts


def _read_text(doc: Document, path: Path, limit: int) -> None:
    codec, note, problem = _encoding(path, limit)
    if problem:
        doc.problem = problem
        return
    if note:
        doc.notes.append(note)
    if path.stat().st_size > limit:
        doc.notes.append(f"cut at {limit / 2**20:g} MiB (data.max_doc_mb)")
    doc.parts = _text_parts(_text_blocks(path, codec, limit), doc.kind)


# --------------------------------------------------------------------------- PDF


_PAGE_NUMBER = re.compile(r"^\W*(page|p\.|seite|pagina)?\s*(\d+|[ivxlc]{1,6}|[IVXLC]{1,6})(\s*(of|/|de|von)\s*\d+)?\W*$",
                          re.I)


def drop_boilerplate(pages: list[str]) -> tuple[list[str], int]:
    """Pages without their page numbers and running headers and footers: among the first
    and last two lines of a page, those that are a page number, and the first or last line
    of a page of four lines or more when (numbers aside) it stands there on at least half
    of the pages (three or more). A page keeps its one line. Returns the pages and the
    number of lines dropped."""
    def key(line: str) -> str:
        return re.sub(r"\d+", "#", " ".join(line.lower().split()))

    split = [p.split("\n") for p in pages]
    ends = []  # (top, bottom, first two and last two) line numbers of each page
    for lines in split:
        idx = [i for i, line in enumerate(lines) if line.strip()]
        if len(idx) >= 4:
            ends.append((idx[0], idx[-1], set(idx[:2] + idx[-2:])))
        else:  # a title page, a page of one table: no running lines to tell from its body
            ends.append((None, None, set(idx[:2] + idx[-2:]) if len(idx) > 1 else set()))
    counts: dict[tuple, int] = {}
    for lines, (top, bottom, _) in zip(split, ends):
        for k in {("top", key(lines[top])) if top is not None else None,
                  ("bottom", key(lines[bottom])) if bottom is not None else None} - {None}:
            counts[k] = counts.get(k, 0) + 1
    repeated = {k for k, c in counts.items() if len(pages) >= 3 and c >= max(3, len(pages) / 2)}
    out, dropped = [], 0
    for lines, (top, bottom, edge) in zip(split, ends):
        gone = {i for i in edge if _PAGE_NUMBER.match(lines[i].strip())}
        gone |= {i for side, i in (("top", top), ("bottom", bottom))
                 if i is not None and (side, key(lines[i])) in repeated}
        dropped += len(gone)
        out.append("\n".join(line for i, line in enumerate(lines) if i not in gone))
    return out, dropped


def _read_pdf(doc: Document, path: Path) -> None:
    from pypdf import PdfReader

    try:
        reader = PdfReader(path)
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")  # many are encrypted with an empty password, for permissions only
            except Exception:
                opened = 0
            if not opened:
                doc.problem = "an encrypted PDF (it needs a password): save a decrypted copy to read it"
                return
        doc.pages = len(reader.pages)
        texts = [page.extract_text() or "" for page in reader.pages]
    except Exception as e:  # pypdf's errors for a damaged file are many kinds
        doc.problem = f"a damaged PDF: pypdf cannot read it ({type(e).__name__}: {_first_line(e)})"
        return
    texts = [clean(t) for t in texts]
    if not any(t.strip() for t in texts):
        doc.problem = NEEDS_OCR if doc.pages else "a PDF with no pages"
        return
    texts, dropped = drop_boilerplate(texts)
    if dropped:
        doc.notes.append(f"{dropped} header, footer and page-number lines dropped")
    doc.parts = [Part(f"page {i}", clean(t)) for i, t in enumerate(texts, start=1) if t.strip()]


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:160]


# --------------------------------------------------------------------------- Word


def _read_docx(doc: Document, path: Path) -> None:
    import docx
    from docx.table import Table

    try:
        word = docx.Document(str(path))
        items = list(word.iter_inner_content())
    except Exception as e:  # not a zip, no document part, broken XML
        doc.problem = f"a damaged Word file: python-docx cannot read it ({type(e).__name__}: {_first_line(e)})"
        return
    heading, lines = "", []

    def flush() -> None:
        text = clean("\n\n".join(lines))
        if text.strip():
            doc.parts.append(Part(heading or "start", text))
        lines.clear()

    for item in items:
        if isinstance(item, Table):
            for row in item.rows:
                cells = list(dict.fromkeys(c.text.strip() for c in row.cells))  # merged cells repeat
                lines.append(" | ".join(cells))
            continue
        text = item.text.strip()
        if not text:
            continue
        style = (item.style.name if item.style is not None else "") or ""
        level = 1 if style == "Title" else int(m.group(1)) if (m := re.match(r"Heading (\d)", style)) else 0
        if level:
            flush()
            heading = text
            lines.append("#" * level + " " + text)
        else:
            lines.append(("- " if style.startswith("List") else "") + text)
    flush()


# --------------------------------------------------------------------------- HTML

_SKIP = {"script", "style", "noscript", "template", "svg", "nav", "header", "footer", "aside", "form", "button",
         "iframe", "head", "select", "canvas", "object"}
_BLOCK = {"p", "div", "section", "article", "main", "ul", "ol", "table", "tr", "blockquote", "pre", "br", "hr",
          "dl", "dt", "dd", "figure", "figcaption", "body", "li", "address", "details", "summary", "caption"}
_HEADINGS = {f"h{i}": i for i in range(1, 7)}


def _read_html(doc: Document, path: Path, limit: int) -> None:
    from lxml import etree, html

    codec, note, problem = _encoding(path, limit)
    if problem:
        doc.problem = problem
        return
    if note:
        doc.notes.append(note)
    text = "".join(_text_blocks(path, codec, limit))
    text = re.sub(r"^\s*<\?xml[^>]*\?>", "", text)  # lxml refuses a str that declares its encoding
    if not text.strip():
        doc.problem = "no text"
        return
    try:
        root = html.document_fromstring(text)
    except (etree.ParserError, ValueError) as e:
        doc.problem = f"cannot read as HTML ({_first_line(e)})"
        return
    heading, out, pre = "", [], 0

    def flush() -> None:
        t = clean("".join(out))
        if t.strip():
            doc.parts.append(Part(heading or "start", t))
        out.clear()

    def add(t: str | None) -> None:
        if t:
            out.append(t if pre else re.sub(r"\s+", " ", t))

    walk = etree.iterwalk(root, events=("start", "end", "comment", "pi"))
    for event, el in walk:
        tag = el.tag.lower() if isinstance(el.tag, str) else ""
        if event in ("comment", "pi"):
            add(el.tail)
        elif event == "start":
            if tag in _SKIP:
                walk.skip_subtree()
            elif tag in _HEADINGS:
                walk.skip_subtree()
                flush()
                heading = " ".join(el.text_content().split())
                out.append(f"\n\n{'#' * _HEADINGS[tag]} {heading}\n\n")
            else:
                if tag == "li":
                    out.append("\n- ")
                elif tag in ("br", "tr"):
                    out.append("\n")
                elif tag in ("td", "th") and el.getprevious() is not None:
                    out.append(" | ")
                elif tag in _BLOCK:
                    out.append("\n\n")
                pre += tag == "pre"
                add(el.text)
        else:
            pre -= tag == "pre"
            if tag in _BLOCK and tag not in ("li", "br", "tr"):
                out.append("\n\n")
            add(el.tail)
    flush()
    # A line of text inside a block keeps the spaces its inline tags left; strip them.
    for p in doc.parts:
        p.text = clean("\n".join(line.strip() for line in p.text.split("\n")))


# --------------------------------------------------------------------------- one document


def extract(shown: str, path: Path, limit_bytes: int) -> Document:
    """One file's text, as parts; a file that gives none says why in `problem`."""
    doc = Document(shown, _kind(path.name))
    try:
        size = path.stat().st_size
        if size == 0:
            doc.problem = "an empty file (0 bytes)"
        elif not path.is_file():
            doc.problem = "not a regular file (a device, pipe or socket)"
        elif doc.kind in ("pdf", "docx") and size > limit_bytes:
            doc.problem = (f"larger than {limit_bytes / 2**20:g} MiB ({size / 2**20:.3g} MiB): not read; "
                           "raise data.max_doc_mb or split it")
        elif doc.kind == "pdf":
            _read_pdf(doc, path)
        elif doc.kind == "docx":
            _read_docx(doc, path)
        elif doc.kind == "html":
            _read_html(doc, path, limit_bytes)
        else:
            _read_text(doc, path, limit_bytes)
    except PermissionError:
        doc.problem, doc.parts = "not readable (permissions)", []
    except OSError as e:
        doc.problem, doc.parts = f"cannot read: {e.strerror or e}", []
    except RecursionError:
        doc.problem, doc.parts = "nested too deeply to read", []
    if not doc.problem and not doc.parts:
        doc.problem = "no text"
    doc.chars = sum(len(p.text) for p in doc.parts)
    return doc


# --------------------------------------------------------------------------- chunks


def chunk_tokens(ids: list[int], size: int, overlap: int) -> list[tuple[int, list[int], list[int]]]:
    """(start, tokens, labels) of each chunk of `ids`: `size` tokens each; every chunk after
    the first starts `overlap` tokens before the end of the one before, and the last one
    early enough to be whole, the tokens already trained on being context only (label -100):
    each token is a target once."""
    out = [(0, ids[:size], list(ids[:size]))]
    end = min(size, len(ids))  # the tokens that were targets so far
    while end < len(ids):
        start = min(end - overlap, len(ids) - size)
        window = ids[start : start + size]
        seen = end - start
        out.append((start, window, [IGNORE] * seen + window[seen:]))
        end = start + len(window)
    return out


def _document_chunks(doc: Document, tok, ds: DataSettings, ids_seen: dict) -> tuple[list[Chunk], int]:
    """The document's chunks (none for one of fewer than MIN_CHUNK_TOKENS tokens) and its
    token count."""
    lead = [t for t in tok("")["input_ids"] if t != tok.eos_token_id]
    ids, starts = list(lead), []
    texts = [p.text + ("\n\n" if i < len(doc.parts) - 1 else "") for i, p in enumerate(doc.parts)]
    for i in range(0, len(texts), 64):  # a few MB of text per tokenizer call
        for part, encoded in zip(doc.parts[i : i + 64], prompts.encode(tok, texts[i : i + 64], special=False)):
            starts.append((len(ids), part.where))
            ids += [ids_seen.setdefault(t, t) for t in encoded]
    if len(ids) - len(lead) < MIN_CHUNK_TOKENS:
        return [], len(ids)
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    chunks = []
    for start, window, labels in chunk_tokens(ids, ds.max_seq_len, ds.chunk_overlap):
        first = start + next(i for i, x in enumerate(labels) if x != IGNORE)  # where its new text starts
        where = next((w for s, w in reversed(starts) if s <= first), starts[0][1])
        chunks.append(Chunk(window, labels, doc.file, where))
    return chunks, len(ids)


def _words(text: str) -> list[str]:
    return re.sub(r"[\W_]+", " ", unicodedata.normalize("NFKC", text).casefold()).split()


class Duplicates:
    """Exact (normalised-text hash) and near (MinHash of word shingles, LSH bands) duplicates
    of the chunks kept so far."""

    def __init__(self):
        import numpy as np

        rng = np.random.default_rng(0)
        self.np, self.prime = np, (1 << 31) - 1
        self.a = rng.integers(1, self.prime, PERMUTATIONS, dtype=np.uint64)
        self.b = rng.integers(0, self.prime, PERMUTATIONS, dtype=np.uint64)
        self.exact: set[bytes] = set()
        self.bands: dict[bytes, list[int]] = {}
        self.signatures: list = []

    def check(self, text: str) -> str:
        """"" for a new chunk (then remembered), else why it is a duplicate."""
        np = self.np
        words = _words(text)
        digest = hashlib.blake2b(" ".join(words).encode(), digest_size=16).digest()
        if digest in self.exact:
            return DROP_EXACT
        k = min(SHINGLE_WORDS, max(1, len(words)))
        shingles = {zlib.crc32(" ".join(words[i : i + k]).encode()) for i in range(max(1, len(words) - k + 1))}
        x = np.fromiter(shingles, dtype=np.uint64, count=len(shingles))
        sig = ((x[:, None] * self.a[None, :] + self.b) % self.prime).min(axis=0)
        rows = PERMUTATIONS // BANDS
        keys = [bytes([b]) + sig[b * rows : (b + 1) * rows].tobytes() for b in range(BANDS)]
        for key in keys:
            for other in self.bands.get(key, ()):
                if float((self.signatures[other] == sig).mean()) >= NEAR_DUPLICATE:
                    return DROP_NEAR
        self.exact.add(digest)
        for key in keys:
            self.bands.setdefault(key, []).append(len(self.signatures))
        self.signatures.append(sig)
        return ""


# --------------------------------------------------------------------------- loading


def read_documents(path: str, ds: DataSettings, tok, progress: Progress, ids_seen: dict,
                   limit_rows: int = 0) -> tuple[list[tuple[Document, list[Chunk], int]], list[Document], list[str]]:
    """Every document of `path` read and chunked, one at a time: ([(document, its chunks,
    its tokens)], the files that gave no text, notes)."""
    resolve_data_path(path)  # a path that is not there: its one line
    _, found, problems, notes = find_documents(path, ds)
    if not found and not problems:
        raise DataError(f"no documents found (looked for {', '.join(DOCUMENT_TYPES)}"
                        + (f", {ds.include}" if ds.include else "") + ")", file=path)
    sizes = []
    for _, p in found:
        try:
            sizes.append(p.stat().st_size)
        except OSError:
            sizes.append(0)
    progress.total, progress.read = sum(sizes), 0
    limit = ds.max_doc_mb << 20
    read, chunks_made = [], 0
    for n, ((shown, p), size) in enumerate(zip(found, sizes)):
        if limit_rows and chunks_made >= limit_rows:
            notes.append(f"stopped after {chunks_made} chunks (data.max_rows); {len(found) - n} files not read")
            break
        doc = extract(shown, p, limit)
        if doc.problem:
            problems.append(doc)
        else:
            chunks, tokens = _document_chunks(doc, tok, ds, ids_seen)
            if not chunks:
                doc.problem = f"too short: fewer than {MIN_CHUNK_TOKENS} tokens"
                problems.append(doc)
            else:
                read.append((doc, chunks, tokens))
                chunks_made += len(chunks)
        doc.parts = []  # the text is in the chunks now
        progress.read += size
        progress.rows(chunks_made)
    progress.rows(chunks_made, final=True)
    return read, problems, notes


def _entry(doc: Document, chunks: int, tokens: int, split: str, dropped: dict) -> dict:
    return {"file": doc.file, "kind": doc.kind, "chars": doc.chars, "pages": doc.pages,
            "chunks": chunks, "tokens": tokens, "split": split, "dropped": dropped, "problem": doc.problem,
            "notes": doc.notes}


def load_documents(ds: DataSettings, tok, seed: int, progress=None) -> SFTData:
    """A folder or file of documents as chunks: split by document, duplicates dropped, with
    the report of every file (see the module docstring)."""
    if ds.chunk_overlap >= ds.max_seq_len:
        raise DataError(f"data.chunk_overlap ({ds.chunk_overlap}) must be below data.max_seq_len "
                        f"({ds.max_seq_len})", file=ds.path)
    reading = Progress(progress)
    ids_seen: dict[int, int] = {}
    read, problems, notes = read_documents(ds.path, ds, tok, reading, ids_seen, ds.max_rows)
    eval_file = eval_source(ds)
    eval_rows: list[SFTExample] = []
    held: list = []
    if eval_file and is_documents(eval_file, ds.include):
        held, eval_problems, eval_notes = read_documents(eval_file, ds, tok, Progress(), ids_seen)
        problems += eval_problems
        notes += [f"held out ({eval_file}): {n}" for n in eval_notes]
        train_docs = read
    elif eval_file:
        stats = {"total": 0, "dropped": {}, "truncated": 0}
        rows, fmt = rows_and_format(eval_file, ds)
        eval_rows = tokenize_rows(rows, fmt, tok, ds, eval_file, stats)
        train_docs = read
    else:
        train_docs, held = split_rows(read, ds.eval_fraction, seed)
    dups = Duplicates()
    dropped: dict[str, int] = {}
    entries, train, evals = [], [], list(eval_rows)
    for docs, split, out in ((train_docs, "train", train), (held, "held out", evals)):
        for doc, chunks, tokens in docs:
            texts = tok.batch_decode([[t for t in c.labels if t != IGNORE] for c in chunks])
            mine: dict[str, int] = {}
            for c, text in zip(chunks, texts):
                why = dups.check(text)
                if why and split != "train":
                    why = DROP_HELD_OUT
                if why:
                    mine[why] = mine.get(why, 0) + 1
                    dropped[why] = dropped.get(why, 0) + 1
                else:
                    out.append(c)
            entries.append(_entry(doc, len(chunks) - sum(mine.values()), tokens, split, mine))
    total = sum(len(c) for _, c, _ in train_docs + held)
    if not train:
        raise DataError(f"no chunks left to train on: {len(read)} documents read, {len(problems)} not"
                        + (f" (first: {problems[0].file}: {problems[0].problem})" if problems else ""), file=ds.path)
    entries.sort(key=lambda e: e["file"])
    listed = [_entry(d, 0, 0, "", {}) for d in problems] + entries[: max(0, MAX_LISTED - len(problems))]
    if len(entries) + len(problems) > len(listed):
        notes.append(f"{len(entries) + len(problems) - len(listed)} more files read (not listed)")
    lengths, hist = length_stats([len(e.input_ids) for e in train + evals])
    report = ValidationReport(
        file=ds.path, format=FORMAT, rows_total=total + len(eval_rows), rows_kept=len(train) + len(evals),
        dropped=dropped, token_lengths=lengths, histogram=hist, train_rows=len(train), eval_rows=len(evals),
        eval_file=eval_file, documents=listed, notes=notes)
    return SFTData(train, evals, report)


def preview_chunks(data: SFTData, tok, n: int = 20, chars: int = 400) -> list[dict]:
    """The first chunks of training and of the held-out documents, as text, with where each
    comes from (the Data tab's preview)."""
    picks = [("train", c) for c in data.train[: n - min(len(data.eval), n // 4)]]
    picks += [("held out", c) for c in data.eval[: n - len(picks)]]
    texts = tok.batch_decode([[t for t in c.labels if t != IGNORE] for _, c in picks], skip_special_tokens=True)
    return [{"file": getattr(c, "file", ""), "where": getattr(c, "where", ""), "split": split,
             "tokens": len(c.input_ids), "text": text[:chars] + ("…" if len(text) > chars else "")}
            for (split, c), text in zip(picks, texts)]
