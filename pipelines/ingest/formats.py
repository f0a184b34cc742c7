"""The file formats kb parses, by file extension."""

from pathlib import Path

FORMATS = {
    ".pdf": "pdf",
    ".html": "html", ".htm": "html",
    ".md": "md", ".markdown": "md",
    ".txt": "txt", ".text": "txt",
    ".docx": "docx",
    ".pptx": "pptx",
    ".xlsx": "xlsx",
    ".csv": "csv",
    ".eml": "eml",
}


class UnsupportedFormat(ValueError):
    pass


def supported(path: str | Path) -> bool:
    return Path(path).suffix.lower() in FORMATS


def format_of(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    try:
        return FORMATS[suffix]
    except KeyError:
        supported = ", ".join(sorted(FORMATS))
        raise UnsupportedFormat(f"unsupported file type {suffix or '(no extension)'!r}; kb reads {supported}") from None
