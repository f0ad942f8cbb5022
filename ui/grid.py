"""The Compare tab's X/Y grid: cells laid out with row and column labels (PIL only)."""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

MIN_CELL = 160  # tiny demo outputs are scaled up (nearest) so the grid stays readable
PAD = 6


def parse_numbers(text: str, *, kind=float, name: str = "values") -> list:
    from backend.errors import InvalidParameter

    items = [t.strip() for t in (text or "").replace(";", ",").split(",") if t.strip()]
    if not items:
        raise InvalidParameter(f"{name}: give a comma-separated list, e.g. 0, 0.5, 1", param=name)
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise InvalidParameter(f"{name}: {text!r} is not a comma-separated list of numbers", param=name) from None


def first_frame(path: str | Path) -> Image.Image:
    path = Path(path)
    if path.suffix.lower() == ".mp4":
        import imageio.v3 as iio

        return Image.fromarray(iio.imread(path, index=0, plugin="FFMPEG")).convert("RGB")
    with Image.open(path) as img:
        return img.convert("RGB")


def compose(cells: list[list[Image.Image | str | None]], x_labels: list[str], y_labels: list[str],
            x_title: str, y_title: str) -> Image.Image:
    """cells[row][col]; a cell without an image is drawn as a grey box saying why: its text
    ("cancelled", "failed"), or "failed" for None."""
    font = ImageFont.load_default()
    sample = next((c for row in cells for c in row if isinstance(c, Image.Image)), None)
    w, h = sample.size if sample else (MIN_CELL, MIN_CELL)
    zoom = max(1, -(-MIN_CELL // max(1, min(w, h))))
    cw, ch = w * zoom, h * zoom
    left = max([font.getlength(s) for s in y_labels + [y_title]] + [40]) + 2 * PAD
    top = 2 * (font.size + PAD) + PAD if hasattr(font, "size") else 40
    grid = Image.new("RGB", (int(left + len(x_labels) * (cw + PAD) + PAD), int(top + len(y_labels) * (ch + PAD) + PAD)),
                     "white")
    draw = ImageDraw.Draw(grid)
    draw.text((PAD, PAD), f"{y_title} \\ {x_title}", fill="black", font=font)
    for j, label in enumerate(x_labels):
        draw.text((left + j * (cw + PAD), top - font.size - PAD if hasattr(font, "size") else 20), label,
                  fill="black", font=font)
    for i, label in enumerate(y_labels):
        y = top + i * (ch + PAD)
        draw.text((PAD, y + ch // 2), label, fill="black", font=font)
        for j in range(len(x_labels)):
            x = int(left + j * (cw + PAD))
            cell = cells[i][j] if i < len(cells) and j < len(cells[i]) else None
            if not isinstance(cell, Image.Image):
                draw.rectangle([x, y, x + cw, y + ch], fill=(200, 200, 200))
                draw.text((x + PAD, y + PAD), cell or "failed", fill="black", font=font)
            else:
                grid.paste(cell.resize((cw, ch), Image.NEAREST), (x, int(y)))
    return grid
