"""The plots' pictures (the Compare grid and the X/Y/Z plot): cells laid out with row, column and block
labels inside the plot budget of backend/limits.py (PIL only)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

MIN_CELL = 160  # tiny demo outputs are scaled up (nearest) so the grid stays readable
MIN_SIDE = 8  # the smallest a cell is scaled down to, to keep a plot inside its pixel budget
MAX_LABEL = 60  # characters of an axis label drawn (a long Prompt S/R value is cut, with "…")
PAD = 6
FONT_SIZE = 20  # px: Pillow's default font is 10 px, whose 2 px space ran "LoRA scale" together (#26)


@lru_cache(maxsize=1)
def label_font() -> ImageFont.ImageFont:
    """The labels' font: Pillow's bundled one at FONT_SIZE (no font file needed on the server)."""
    return ImageFont.load_default(size=FONT_SIZE)


def parse_numbers(text: str, *, kind=float, name: str = "values") -> list:
    from backend.errors import InvalidParameter

    items = [t.strip() for t in (text or "").replace(";", ",").split(",") if t.strip()]
    if not items:
        raise InvalidParameter(f"{name}: give a comma-separated list, e.g. 0, 0.5, 1", param=name)
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise InvalidParameter(f"{name}: {text!r} is not a comma-separated list of numbers", param=name) from None


def cell_size(params: dict, defaults: dict) -> tuple[int, int]:
    """The size each cell's picture will have: the request's, else the model's default (for the plot budget)."""
    def side(name):
        value = params.get(name) or (defaults or {}).get(name)
        return value if isinstance(value, int) and value > 0 else MIN_CELL
    return side("width"), side("height")


def first_frame(path: str | Path) -> Image.Image:
    path = Path(path)
    if path.suffix.lower() == ".mp4":
        import imageio.v3 as iio

        return Image.fromarray(iio.imread(path, index=0, plugin="FFMPEG")).convert("RGB")
    with Image.open(path) as img:
        return img.convert("RGB")


def compose(cells: list[list[Image.Image | str | None]], x_labels: list[str], y_labels: list[str],
            x_title: str, y_title: str) -> Image.Image:
    """The Compare tab's grid, ``cells[row][col]``: one block of ``compose_xyz``, its corner naming both
    axes. A cell without an image is a grey box saying why ("cancelled", "failed"; None: "failed")."""
    return compose_xyz([cells], x_labels, y_labels, [""], corner(x_title, y_title))[0]


def corner(x_title: str, y_title: str) -> str:
    """The top-left label of a grid: its Y axis over its X axis ("seed \\ adapter weight")."""
    return f"{y_title} \\ {x_title}"


def _label(text) -> str:
    text = str(text)
    return text if len(text) <= MAX_LABEL else text[:MAX_LABEL - 1] + "…"


def geometry(w: int, h: int, x_labels: list, y_labels: list, z_labels: list, corner: str) -> dict:
    """Where everything of a plot goes, for cells of ``w`` x ``h`` pictures: small pictures are scaled up
    (nearest) to MIN_CELL so the plot stays readable, and every cell is scaled down as far as it takes to
    keep the whole picture inside the plot budget (backend/limits.py, MAX_PLOT_PIXELS and MAX_PLOT_SIDE).
    Raises InvalidParameter (naming the size) when even the smallest cells do not fit, so a plot is refused
    before any of its jobs is queued. Labels are cut to MAX_LABEL characters."""
    from backend.service import MAX_PLOT_PIXELS, MAX_PLOT_SIDE, check_plot_size

    font = label_font()
    line = int(FONT_SIZE + PAD)
    corner = _label(corner)
    x_labels, y_labels, z_labels = ([_label(t) for t in labels] for labels in (x_labels, y_labels, z_labels))
    w, h = max(1, int(w)), max(1, int(h))
    left = int(max([font.getlength(t) for t in [*y_labels, corner]] + [40]) + 2 * PAD)
    z_head = line + PAD if any(z_labels) else 0
    blocks = max(1, len(z_labels))

    def wrap(text: str, width: float) -> list[str]:
        """Column labels wrap onto at most 3 lines of the cell's width."""
        lines, cur = [], ""
        for word in text.split(" "):
            trial = f"{cur} {word}".strip()
            if cur and font.getlength(trial) > width:
                lines.append(cur)
                if len(lines) == 3:
                    return lines
                cur = word
            else:
                cur = trial
        lines.append(cur)
        return lines[:3]

    def at(zoom: float) -> dict:
        cw, ch = max(1, round(w * zoom)), max(1, round(h * zoom))
        x_wrapped = [wrap(t, cw) for t in x_labels]
        top = z_head + line + max([len(x) for x in x_wrapped] + [1]) * line + PAD  # corner title, column labels
        block_h = top + len(y_labels) * (ch + PAD) + PAD
        return {"cell_size": [w, h], "font_size": FONT_SIZE, "zoom": zoom, "cell_box_size": [cw, ch], "pad": PAD,
                "left": left, "top": top,
                "z_head": z_head, "line": line, "block_height": block_h, "x_wrapped": x_wrapped,
                "labels": [x_labels, y_labels, z_labels, corner],
                "size": [left + len(x_labels) * (cw + PAD) + PAD, block_h * blocks]}

    zoom, smallest = float(max(1, -(-MIN_CELL // min(w, h)))), min(1.0, MIN_SIDE / min(w, h))
    for _ in range(32):  # shrink until it fits (each round by the factor still missing; a few rounds at most)
        g = at(zoom)
        width, height = g["size"]
        over = max(width * height / MAX_PLOT_PIXELS, (max(width, height) / MAX_PLOT_SIDE) ** 2)
        if over <= 1 or zoom <= smallest:
            break
        zoom = max(smallest, zoom / over ** 0.5 * 0.97)  # the cells keep their shape
    check_plot_size(*g["size"])
    return g


def compose_xyz(blocks: list[list[list[Image.Image | str | None]]], x_labels: list[str], y_labels: list[str],
                z_labels: list[str], corner: str) -> tuple[Image.Image, dict]:
    """An X/Y/Z plot as ONE image: ``blocks[z][row][col]``, one X/Y grid per Z value stacked top to
    bottom, each headed by its Z label (when there is a Z axis), column labels above, row labels on
    the left; laid out by ``geometry`` from the first picture's size. Returns the image and its layout
    (cell size, zoom, margins and each cell's box), which the plot's sidecar records."""
    font = label_font()
    sample = next((c for z in blocks for row in z for c in row if isinstance(c, Image.Image)), None)
    w, h = sample.size if sample else (MIN_CELL, MIN_CELL)
    g = geometry(w, h, x_labels, y_labels, z_labels, corner)
    x_labels, y_labels, z_labels, corner = g["labels"]
    (cw, ch), left, top, line, z_head = g["cell_box_size"], g["left"], g["top"], g["line"], g["z_head"]
    block_h = g["block_height"]
    resample = Image.NEAREST if g["zoom"] >= 1 else Image.LANCZOS
    grid = Image.new("RGB", tuple(g["size"]), "white")
    draw = ImageDraw.Draw(grid)
    boxes = []
    for k, cells in enumerate(blocks):
        y0 = k * block_h
        if z_head:
            draw.text((PAD, y0 + PAD), z_labels[k], fill="black", font=font)
        draw.text((PAD, y0 + z_head + PAD), corner, fill="black", font=font)
        for j, lines in enumerate(g["x_wrapped"]):
            for n, text in enumerate(lines):
                draw.text((left + j * (cw + PAD), y0 + z_head + line + n * line), text, fill="black", font=font)
        for i, label in enumerate(y_labels):
            y = y0 + top + i * (ch + PAD)
            draw.text((PAD, y + ch // 2 - FONT_SIZE // 2), label, fill="black", font=font)
            for j in range(len(x_labels)):
                x = left + j * (cw + PAD)
                cell = cells[i][j] if i < len(cells) and j < len(cells[i]) else None
                if isinstance(cell, Image.Image):
                    grid.paste(cell.convert("RGB").resize((cw, ch), resample), (x, y))
                else:
                    draw.rectangle([x, y, x + cw - 1, y + ch - 1], fill=(200, 200, 200))
                    draw.text((x + PAD, y + PAD), cell or "failed", fill="black", font=font)
                boxes.append({"z": k, "y": i, "x": j, "box": [x, y, x + cw, y + ch]})
    layout = {k: g[k] for k in ("cell_size", "font_size", "zoom", "cell_box_size", "pad", "left", "top",
                                "block_height", "size")}
    return grid, {**layout, "boxes": boxes}
