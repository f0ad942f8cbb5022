"""<lora:NAME:WEIGHT> in a prompt (A1111): the one parser the UI, the HTTP API and the CLI share."""
from __future__ import annotations

import pytest

from backend.errors import InvalidParameter
from backend.lora import prompt_tags


def test_tags_leave_the_text_and_become_adapters():
    text, adapters = prompt_tags.split("a cat, <lora:ink:0.8> on a mat <lora:film>")
    assert text == "a cat, on a mat"
    assert adapters == [{"name": "ink", "scale": 0.8}, {"name": "film"}]  # no weight: the adapter's preferred one
    assert prompt_tags.split("<LORA:x:-1.5>") == ("", [{"name": "x", "scale": -1.5}])
    assert prompt_tags.split("no tags here") == ("no tags here", [])


@pytest.mark.parametrize("prompt, fragment", [
    ("a <lora::1>", "names no adapter"),
    ("a <lora:x:heavy>", "is not a number"),
    ("a <lora:x:inf>", "is not finite"),
])
def test_bad_tags_are_refused_by_what_is_wrong(prompt, fragment):
    with pytest.raises(InvalidParameter, match=fragment) as err:
        prompt_tags.split(prompt)
    assert err.value.param == "prompt"


def test_an_adapter_named_twice_is_refused():
    with pytest.raises(InvalidParameter, match="also in the adapter list"):
        prompt_tags.merge([{"name": "ink", "scale": 1.0}], [{"name": "ink", "scale": 0.5}])
    assert prompt_tags.merge([{"name": "a", "scale": 1}], [{"name": "b", "scale": 2}]) == \
        [{"name": "a", "scale": 1}, {"name": "b", "scale": 2}]


def test_a_tag_between_two_commas_leaves_one():
    """#26: PNG info left ",," where a tag stood ("a cat, <lora:ink:0.5>, sitting" -> "a cat,, sitting")."""
    from backend.lora import prompt_tags
    from backend.pnginfo import parse_a1111

    assert prompt_tags.split("a cat, <lora:ink:0.5>, sitting, <lora:b:1>")[0] == "a cat, sitting"
    got = parse_a1111("a cat, <lora:ink:0.5>, sitting\nSteps: 3, Seed: 1, Size: 64x64")
    assert got["params"]["prompt"] == "a cat, sitting"
    assert prompt_tags.tidy("a , , , b") == "a, b" and prompt_tags.tidy(", x ,") == "x"


def test_two_weights_read_as_a1111_reads_them_text_encoder_first():
    """#28 item 3: A1111's <lora:NAME:TE:UNET> (extensions-builtin/Lora/extra_networks_lora.py): the first number
    is the text encoders' weight, the second the denoisers' (the first when alone); te= / unet= name them."""
    def scale(tag):
        return prompt_tags.split(f"a {tag}")[1][0].get("scale")

    assert scale("<lora:x:0.5:1>") == {"text_encoder": 0.5, "denoisers": 1.0}
    assert scale("<lora:x:0.7:0.7>") == 0.7 and scale("<lora:x:0.7>") == 0.7
    assert scale("<lora:x:unet=0.3>") == {"text_encoder": 1.0, "denoisers": 0.3}  # A1111: te defaults to 1
    assert scale("<lora:x:0.2:unet=0.9>") == {"text_encoder": 0.2, "denoisers": 0.9}
    assert scale("<lora:x:te=0:unet=1>") == {"text_encoder": 0.0, "denoisers": 1.0}
    for tag, fragment in (("<lora:x:1:1:8>", "dynamic rank"), ("<lora:x:dyn=8>", "dyn= is not supported"),
                          ("<lora:x:1:two>", "is not a number")):
        with pytest.raises(InvalidParameter, match=fragment):
            prompt_tags.split(tag)
