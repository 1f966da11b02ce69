"""The one generic registry (``rope_extend.registry``): names, refusals, listeners, lazy entries."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from rope_extend import RopeExtendError
from rope_extend.registry import Registry


def test_register_as_a_call_and_as_a_decorator_in_order():
    things = Registry("thing")
    first = things.register(SimpleNamespace(name="first"))

    @things.register(name="second")
    def second():
        return 2

    assert things.names() == ["first", "second"] == list(things)
    assert things.get("first") is first and things.get("second")() == 2 and "second" in things and len(things) == 2
    assert things.unregister("first") is first and things.names() == ["second"] and things.unregister("first") is None


def test_unknown_duplicate_and_reserved_names_are_refused():
    things = Registry("widget", reserved=("compare",), identifiers=True)
    things.register(SimpleNamespace(name="spanner"))
    with pytest.raises(
        RopeExtendError, match=r"unknown widget 'spaner' \(did you mean 'spanner'\?\); allowed: spanner"
    ):
        things.get("spaner")
    with pytest.raises(RopeExtendError, match="unknown widget"):
        things.get(["spanner"])  # an unhashable name from YAML is unknown, not a TypeError
    with pytest.raises(RopeExtendError, match="a widget named 'spanner' is already registered"):
        things.register(SimpleNamespace(name="spanner"))
    for bad in ("compare", "not-an-identifier", "", None):
        with pytest.raises(RopeExtendError, match="must be an identifier other than compare, got"):
            things.register(SimpleNamespace(name=bad))
    assert things.names() == ["spanner"]


def test_a_listener_hears_later_registrations_and_can_refuse_them():
    heard = []
    things = Registry("thing")
    things.register(SimpleNamespace(name="before"))

    def listener(item):
        if item.name == "bad":
            raise RopeExtendError("no")
        heard.append(item.name)

    things.on_register(listener)
    things.register(SimpleNamespace(name="after"))
    with pytest.raises(RopeExtendError, match="no"):
        things.register(SimpleNamespace(name="bad"))
    assert heard == ["after"] and things.names() == ["before", "after"]  # all or nothing


def test_a_lazy_entry_is_listed_without_importing_its_module():
    things = Registry("export target")
    things.register_lazy("json", "json.tool:main")  # a module no test imports
    sys.modules.pop("json.tool", None)
    assert things.names() == ["json"] and "json.tool" not in sys.modules
    assert things.get("json").__module__ == "json.tool" and "json.tool" in sys.modules


def test_unregister_listeners_hear_loaded_entries_once_they_are_gone():
    heard = []
    things = Registry("thing")
    first = things.register(SimpleNamespace(name="first"))
    things.register_lazy("lazy", "json:dumps")
    things.on_unregister(lambda item: heard.append((item, item.name in things)))
    assert things.unregister("first") is first and heard == [(first, False)]
    assert things.unregister("lazy") is None and things.unregister("first") is None
    assert heard == [(first, False)]  # a lazy entry never loaded was installed nowhere; an absent one is nothing


def test_a_lazy_entry_named_otherwise_at_its_path_is_refused_and_stays_listed():
    things = Registry("thing")
    things.register_lazy("wrong", "tests.test_registry:OTHER")  # an entry named "other"
    things.register_lazy("named", "tests.test_registry:NAMED")
    with pytest.raises(
        RopeExtendError, match=r"a thing listed as 'wrong' at tests.test_registry:OTHER is named 'other'"
    ):
        things.get("wrong")
    assert things.names() == ["wrong", "named"] and things.get("named") is NAMED


def test_a_check_reading_every_entry_sees_the_one_loading_as_loaded():
    seen = []
    things = Registry("thing", check=lambda item: seen.append([t.name for t in things.values()]))
    things.register_lazy("named", "tests.test_registry:NAMED")
    things.register_lazy("other", "tests.test_registry:OTHER")
    assert [t.name for t in things.values()] == ["named", "other"]
    assert seen == [["named", "other"], ["named", "other"]]  # each check ran once, with both entries loaded


NAMED = SimpleNamespace(name="named")
OTHER = SimpleNamespace(name="other")
