"""The LoRA browser (in the Generate tab, a drawer right under the prompt, as A1111's Extra Networks
is): a card per adapter in the library with its preview, trigger words, base-model family,
rank/alpha/size; search, filter by family, sort by name, date, size or use
(``Studio.adapter_use_counts``: succeeded jobs that used it). By default it shows the adapters that
fit the loaded model, and folds the others into one line each with the reason in plain words
(``views.misfit_reason``).

While the panel is open it follows the library (an import, a deletion, a model switch redraw
the cards within ``POLL_S``). Clicking a trigger word inserts it into the prompt (in the page, no server round trip); a card's
"Add to stack", or a click anywhere else on a fitting card, puts the adapter into the Generate tab's
stack through the same handler as the stack's own Add button. "Make preview" (on a card with no
picture) queues ``Studio.make_preview``: one 4-step job whose image the Studio caches under
``<data-dir>/previews`` and shows on the card from then on. The cards come from
``Studio.adapter_cards()`` (headers only, cached); ``views.card_html`` escapes everything a file says.
"""
from __future__ import annotations

import gradio as gr

from . import views
from .stack import EDIT as STACK_EDIT
from .views import error_html, ok_html, readable

POLL_S = 2.0  # how often an open browser asks whether the library changed (a cheap signature)

# Delegated clicks on the cards (the HTML is re-rendered, so listeners live on the document):
# a trigger word is appended to the prompt, ", " separated; "Make preview" posts the adapter's name
# (with a nonce, so asking again is a change) to a hidden textbox; "Add to stack", or a click on a
# fitting card's body (not on a button or link), posts it to another.
PAGE_JS = """
() => {
  const setText = (el, value) => {
    el.value = value;
    el.dispatchEvent(new Event("input", {bubbles: true}));
  };
  document.addEventListener("click", (e) => {
    const trig = e.target.closest && e.target.closest("#lora-browser .ls-trigger");
    if (trig) {
      const box = document.querySelector("#prompt textarea");
      if (!box) return;
      const word = trig.getAttribute("data-trigger") || "";
      const cur = box.value.replace(/[\\s,]+$/, "");
      setText(box, cur ? `${cur}, ${word}` : word);
      return;
    }
    const post = (id, name) => {
      const box = document.querySelector(`#${id} textarea, #${id} input`);
      if (box) setText(box, `${name || ""}\\n${Date.now()}`);
    };
    const prev = e.target.closest && e.target.closest("#lora-browser .ls-preview");
    if (prev) {
      post("lora-browser-preview", prev.getAttribute("data-name"));
      return;
    }
    const add = e.target.closest && (e.target.closest("#lora-browser .ls-add") ||
      (!e.target.closest("button, a, input, textarea, select") &&
       e.target.closest("#lora-browser .ls-lcard:not(.ls-lcard-off)")));
    if (add) post("lora-browser-action", add.getAttribute("data-name"));
  });
}
"""


def build(studio, gen) -> None:
    with gr.Accordion("LoRA browser", open=False, elem_id="lora-browser") as panel:
        with gr.Row():
            query = gr.Textbox(label="Search", placeholder="name or trigger word", scale=3, elem_id="lora-search")
            family = gr.Dropdown(label="Family", choices=[views.ALL_FAMILIES], value=views.ALL_FAMILIES, scale=2,
                                 elem_id="lora-family")
            fits = gr.Checkbox(label="fits the loaded model", value=True, scale=1, elem_id="lora-fits",
                               info="the others fold into one line each, with the reason")
            sort = gr.Dropdown(label="Sort", choices=list(views.BROWSER_SORTS), value="name", scale=1,
                               elem_id="lora-sort")
            refresh = gr.Button("Refresh", scale=0, min_width=80, elem_id="lora-refresh")
        cards = gr.HTML(elem_id="lora-cards")
        action = gr.Textbox(visible="hidden", elem_id="lora-browser-action")
        make = gr.Textbox(visible="hidden", elem_id="lora-browser-preview")
        # while the panel is open the cards follow the library (imports, deletions, a model switch)
        timer = gr.Timer(POLL_S, active=False)
        seen = gr.State(None)  # the library signature the cards were drawn from

    def show(q, fam, only_fit, order):
        try:
            sig = studio.library_signature()
            uses = studio.adapter_use_counts()
            all_cards = [{**c, "uses": uses.get(c["name"], 0)} for c in studio.adapter_cards()]
        except Exception as exc:
            return gr.update(), error_html(readable(exc)), None
        fams = views.browser_families(all_cards)
        fam = fam if fam in fams else views.ALL_FAMILIES
        shown = views.filter_cards(all_cards, q, fam, bool(only_fit), order)
        misfits = ([c for c in views.filter_cards(all_cards, q, fam, False, "name") if not c.get("fits")]
                   if only_fit else None)
        return gr.update(choices=fams, value=fam), views.cards_html(shown, len(all_cards), misfits), sig

    def tick(sig, q, fam, only_fit, order):
        try:
            if studio.library_signature() == sig:
                return gr.update(), gr.update(), sig
        except Exception:
            return gr.update(), gr.update(), sig
        return show(q, fam, only_fit, order)

    inputs, outputs = [query, family, fits, sort], [family, cards, seen]
    # Every event that draws the cards is in one queue, one at a time, in the order the page sent them:
    # on their own they ran side by side, and a slower, older one (the box's last query, the timer's
    # tick) could land after a newer one (the "fits" box) and draw the cards it asked for instead.
    one = {"api_visibility": "private", "concurrency_id": "lora-cards", "concurrency_limit": 1}
    panel.expand(show, inputs, outputs, **one)
    panel.expand(lambda: gr.Timer(active=True), None, timer, api_visibility="private", queue=False)
    panel.collapse(lambda: gr.Timer(active=False), None, timer, api_visibility="private", queue=False)
    timer.tick(tick, [seen, *inputs], outputs, show_progress="hidden", trigger_mode="always_last", **one)
    refresh.click(show, inputs, outputs, **one)
    for comp in (family, fits, sort):
        comp.input(show, inputs, outputs, **one)
    query.change(show, inputs, outputs, trigger_mode="always_last", **one)
    # a change that lands while the previous one is still answered can be dropped (gradio-app/gradio#3876:
    # the cards then keep the results of an older query); leaving the box shows the query it holds
    query.blur(show, inputs, outputs, trigger_mode="always_last", **one)

    def add(value, stack, model_id):
        name = str(value or "").split("\n", 1)[0]
        if not name:
            return [gr.update()] * (2 + len(gen.row_outputs()))
        out = gen.add_adapter(name, stack, model_id)
        if not out[-1]:
            out[-1] = ok_html(f"added {name} to the LoRA stack")
        return out

    action.change(add, [action, gen.stack, gen.model], [gen.stack, *gen.row_outputs(), gen.status], **STACK_EDIT)

    def preview(request: gr.Request, value):
        name = str(value or "").split("\n", 1)[0]
        if not name:
            return gr.update()
        try:
            job = studio.of(request).make_preview(name)
        except Exception as exc:
            return error_html(readable(exc))
        return ok_html(f"making a preview of {name} (job {views.job_label(job)}); it shows on its card when done")

    make.change(preview, [make], [gen.status], api_visibility="private", queue=False)
