"""The CRD is generated from the pydantic models; the checked-in copies must match, and the models must
reject what the CRD rejects."""
from pathlib import Path

import pydantic
import pytest
import yaml

from pdrollout.operator import crd
from pdrollout.operator.models import PDRolloutSpec, PDRolloutStatus, Phase
ROOT = Path(__file__).resolve().parents[2]
INVALID = list(yaml.safe_load_all((Path(__file__).parent / "invalid-pdrollouts.yaml").read_text()))
VALID = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())["spec"]


@pytest.mark.parametrize("path", ["crds/pdrollout.io_pdrollouts.yaml",
                                  "charts/pdrollout-operator/crds/pdrollout.io_pdrollouts.yaml"])
def test_checked_in_crd_is_generated_from_models(path):
    assert (ROOT / path).read_text() == crd.render(), \
        f"{path} is stale: python -m pdrollout.operator.crd > {path}"


def _walk(node, at="$"):
    yield at, node
    for k, v in (node.get("properties") or {}).items():
        yield from _walk(v, f"{at}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{at}[]")


def test_schema_is_structural():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for at, node in _walk(schema):
        assert "type" in node or node.get("x-kubernetes-int-or-string") or \
            node.get("x-kubernetes-preserve-unknown-fields"), f"{at} has no type"
        assert not {"anyOf", "oneOf", "allOf", "$ref", "const"} & node.keys(), f"{at} is not structural"


def test_printer_columns_and_status_subresource():
    v = crd.crd()["spec"]["versions"][0]
    assert [c["name"] for c in v["additionalPrinterColumns"]] == \
        ["Phase", "Nodes", "Ready", "Ready-Groups", "Makespan(s)", "Recent-TTFT-p99(s)", "Age"]
    assert v["subresources"]["status"] == {}
    # `kubectl scale` reads and writes fields the schema has, of the types the scale subresource needs
    scale = v["subresources"]["scale"]
    props = v["schema"]["openAPIV3Schema"]["properties"]
    assert props["spec"]["properties"]["replicas"]["type"] == "integer" == \
        props["status"]["properties"][scale["statusReplicasPath"].split(".")[-1]]["type"]
    assert scale["specReplicasPath"] == ".spec.replicas"
    assert props["status"]["properties"][scale["labelSelectorPath"].split(".")[-1]]["type"] == "string"
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == [p.value for p in Phase]
    # Every printer column points at a field the schema has.
    for col in v["additionalPrinterColumns"][:-1]:
        top, *rest = col["jsonPath"].strip(".").split(".")
        node = v["schema"]["openAPIV3Schema"]["properties"][top]
        for part in rest:
            node = node["properties"][part]


def test_status_field_names_match_the_model():
    status = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    fields = {f.alias or n for n, f in PDRolloutStatus.model_fields.items()}
    assert set(status["properties"]) == fields | {"kopf"}


def _check_defaults(node: dict, value, at: str) -> int:
    """Every schema default equals what the model fills in for an omitted field."""
    checked = 0
    if "default" in node:
        assert value == node["default"], at
        checked += 1
    for key, sub in (node.get("properties") or {}).items():
        if key not in value:   # an optional without a default: absent on both sides
            assert "default" not in sub, f"{at}.{key}"
            continue
        checked += _check_defaults(sub, value[key], f"{at}.{key}")
    return checked


def test_defaults_match_model_defaults():
    spec_schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    # An unset optional (None) is absent from the object, as in the schema.
    minimal = PDRolloutSpec.model_validate({"image": "i", "model": {"path": "/m"}}).model_dump(by_alias=True,
                                                                                        exclude_none=True)
    assert _check_defaults(spec_schema, minimal, "spec") >= 20


@pytest.mark.parametrize("doc", INVALID, ids=[d["metadata"]["name"] for d in INVALID])
def test_model_rejects_what_the_crd_rejects(doc):
    with pytest.raises(pydantic.ValidationError):
        PDRolloutSpec.model_validate(doc["spec"])


def test_enough_invalid_cases():
    assert len(INVALID) >= 5


@pytest.mark.parametrize("path", ["examples/pdrollout.yaml", "examples/pdrollout-2node.yaml",
                                  "examples/pdrollout-cpu.yaml"])
def test_examples_are_valid(path):
    doc = yaml.safe_load((ROOT / path).read_text())
    assert doc["apiVersion"] == "pdrollout.io/v1alpha1" and doc["kind"] == "PDRollout"
    PDRolloutSpec.model_validate(doc["spec"])


def test_name_limit_comes_from_the_derived_names():
    from pdrollout.operator import builders
    limit = builders.max_name_length()
    assert limit == 52, "63 minus the longest suffix the builders or the StatefulSet controller add"
    assert all(len(n) <= 63 for n in builders.derived_names("a" * limit))
    assert any(len(n) > 63 for n in builders.derived_names("a" * (limit + 1)))
    rules = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert {"rule": f"size(self.metadata.name) <= {limit}"} .items() <= rules[1].items()
