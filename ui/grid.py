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


def compose_xyz(blocks: list[list[list[Image.Image | str | None]]], x_labels: list[str], y_labels: list[str],
                z_labels: list[str], corner: str) -> tuple[Image.Image, dict]:
    """An X/Y/Z plot as ONE image: ``blocks[z][row][col]``, one X/Y grid per Z value stacked top to
    bottom, each headed by its Z label (when there is a Z axis), column labels above, row labels on
    the left. Returns the image and its layout (cell size, zoom, margins and each cell's box), which
    the plot's sidecar records."""
    font = ImageFont.load_default()
    line = int(font.size + PAD)
    sample = next((c for z in blocks for row in z for c in row if isinstance(c, Image.Image)), None)
    w, h = sample.size if sample else (MIN_CELL, MIN_CELL)
    zoom = max(1, -(-MIN_CELL // max(1, min(w, h))))
    cw, ch = w * zoom, h * zoom
    # column labels wrap onto at most 3 lines of the cell's width
    def wrap(text: str, width: float) -> list[str]:
        lines, cur = [], ""
        for word in str(text).split(" "):
            trial = f"{cur} {word}".strip()
            if cur and font.getlength(trial) > width:
                lines.append(cur)
                cur = word
            else:
                cur = trial
        lines.append(cur)
        return lines[:3]
    x_wrapped = [wrap(t, cw) for t in x_labels]
    left = int(max([font.getlength(s) for s in [*y_labels, corner]] + [40]) + 2 * PAD)
    z_head = line + PAD if any(z_labels) else 0
    top = z_head + line + max(len(x) for x in x_wrapped) * line + PAD  # corner title, column labels
    block_h = top + len(y_labels) * (ch + PAD) + PAD
    width = left + len(x_labels) * (cw + PAD) + PAD
    grid = Image.new("RGB", (width, block_h * len(blocks)), "white")
    draw = ImageDraw.Draw(grid)
    boxes = []
    for k, cells in enumerate(blocks):
        y0 = k * block_h
        if z_head:
            draw.text((PAD, y0 + PAD), z_labels[k], fill="black", font=font)
        draw.text((PAD, y0 + z_head + PAD), corner, fill="black", font=font)
        for j, lines in enumerate(x_wrapped):
            for n, text in enumerate(lines):
                draw.text((left + j * (cw + PAD), y0 + z_head + line + n * line), text, fill="black", font=font)
        for i, label in enumerate(y_labels):
            y = y0 + top + i * (ch + PAD)
            draw.text((PAD, y + ch // 2 - font.size // 2), label, fill="black", font=font)
            for j in range(len(x_labels)):
                x = left + j * (cw + PAD)
                cell = cells[i][j] if i < len(cells) and j < len(cells[i]) else None
                if isinstance(cell, Image.Image):
                    grid.paste(cell.convert("RGB").resize((cw, ch), Image.NEAREST), (x, y))
                else:
                    draw.rectangle([x, y, x + cw - 1, y + ch - 1], fill=(200, 200, 200))
                    draw.text((x + PAD, y + PAD), cell or "failed", fill="black", font=font)
                boxes.append({"z": k, "y": i, "x": j, "box": [x, y, x + cw, y + ch]})
    layout = {"cell_size": [w, h], "zoom": zoom, "cell_box_size": [cw, ch], "pad": PAD, "left": left, "top": top,
              "block_height": block_h, "size": list(grid.size), "boxes": boxes}
    return grid, layout
