"""A namespace spec's integer fields: JSON null is refused like any other non-integer (found
by mypy: `{"page_bytes": null}` made a spec without a page size, and a null rank field
raised TypeError, a 500)."""

from __future__ import annotations

import pytest

from sidecar.errors import BadRequest
from sidecar.spec import parse_spec


@pytest.mark.parametrize(
    "body",
    [
        {"page_bytes": None},
        {"page_bytes": 4096, "rank": {"tp": None}},
        {"page_bytes": 4096, "rank": {"tp_size": None}},
        {"page_bytes": 4096, "page_tokens": None},
    ],
)
def test_a_null_integer_field_is_a_bad_request(body):
    with pytest.raises(BadRequest):
        parse_spec(body)


def test_an_absent_optional_field_stays_none_and_defaults_apply():
    spec = parse_spec({"page_bytes": 4096, "host_capacity_bytes": None})
    assert spec.host_capacity_bytes is None
    assert (spec.page_bytes, spec.page_tokens, spec.rank.tp_size) == (4096, 0, 1)
