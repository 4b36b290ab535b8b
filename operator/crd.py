"""The PDRollout CustomResourceDefinition, generated from the pydantic models so the two cannot drift.

    python -m pdrollout.operator.crd > crds/pdrollout.io_pdrollouts.yaml

Pydantic emits JSON Schema (refs, anyOf for optionals, const); Kubernetes wants a structural OpenAPI v3
subset. `structural()` translates the few shapes the models use and rejects anything else loudly.
"""
from __future__ import annotations

import copy
import json
import sys

import yaml

from pdrollout.operator import builders
from pdrollout.operator.models import GROUP, KIND, PLURAL, VERSION, PDRolloutSpec, PDRolloutStatus

_KEEP = {"type", "description", "default", "enum", "minimum", "maximum", "minLength", "maxLength",
         "minItems", "maxItems", "pattern", "items", "properties", "required", "format",
         "x-kubernetes-validations", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
         "nullable", "additionalProperties"}
_DROP = {"title", "$defs"}


def structural(node: dict, defs: dict) -> dict:
    """One pydantic JSON-Schema node -> a structural OpenAPI v3 node."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return structural(merged, defs)
    node = dict(node)
    if "anyOf" in node:
        options = node.pop("anyOf")
        real = [o for o in options if o.get("type") != "null"]
        nullable = len(real) < len(options)
        kinds = {o.get("type") for o in real}
        if len(real) == 1:
            out = structural({**real[0], **node}, defs)
            if nullable:
                out["nullable"] = True
            return out
        if kinds == {"integer", "string"}:  # int | Literal["auto"]: the CEL rule narrows it
            node["x-kubernetes-int-or-string"] = True
            return structural(node, defs)
        raise ValueError(f"unsupported union in CRD schema: {options}")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**structural(node.pop("allOf")[0], defs), **node}
    out = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key not in _KEEP:
            raise ValueError(f"unsupported JSON-Schema keyword {key!r} in CRD schema")
        if key == "default" and value is None:
            continue  # "absent" is how an unset status field looks
        if key == "properties":
            value = {name: structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = structural(value, defs)
        elif key == "additionalProperties":
            continue  # extra="forbid": the API server prunes/rejects unknown fields itself
        out[key] = value
    if "properties" in out:
        out.setdefault("type", "object")
        # An omitted sub-object still gets its children's defaults. Spelled out in full (not `{}`):
        # the API server checks a default against the object's CEL rules before nested defaulting.
        for name, sub in out["properties"].items():
            if sub.get("type") == "object" and name not in out.get("required", ()) and "default" not in sub \
                    and not sub.get("nullable") and not sub.get("required"):
                sub["default"] = _filled(sub)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "x-kubernetes-int-or-string" not in out and "x-kubernetes-preserve-unknown-fields" not in out \
            and "type" not in out:
        raise ValueError(f"schema node without a type: {node}")
    return out


def _filled(node: dict) -> dict:
    """The value an omitted object takes: each child's default."""
    # Copies: a shared object would be written as a YAML anchor/alias.
    return {k: copy.deepcopy(v["default"]) for k, v in node.get("properties", {}).items() if "default" in v}


def model_schema(model) -> dict:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return structural(schema, schema.get("$defs", {}))


def openapi_schema() -> dict:
    spec = model_schema(PDRolloutSpec)
    status = model_schema(PDRolloutStatus)
    # kopf keeps its own progress in status.kopf unless told otherwise; never prune it.
    status["properties"]["kopf"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    spec.pop("default", None)
    spec.pop("description", None)
    status.pop("description", None)
    return {
        "type": "object",
        "required": ["spec"],
        "x-kubernetes-validations": name_rules(),
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def name_rules() -> list[dict]:
    """The rollout's name becomes Service, StatefulSet and pod host names (builders.derived_names): refuse
    at admission a name any of them would reject, instead of accepting it and failing later."""
    limit = builders.max_name_length()
    return [
        {"rule": f"self.metadata.name.matches('{builders.NAME_PATTERN}')",
         "message": "metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting "
                    "with a letter, ending with a letter or digit): it names the rollout's Services"},
        {"rule": f"size(self.metadata.name) <= {limit}",
         "message": f"metadata.name must be at most {limit} characters: the StatefulSet's pods carry "
                    f"'<name>-<revision hash>' in a 63-character label"},
        # a fleet's groups are PDRollouts named '<name>-<index>' (fleet.py): the same limit holds for them
        {"rule": f"!has(self.spec.replicas) || self.spec.replicas < 1 || "
                 f"size(self.metadata.name) + size(string(self.spec.replicas - 1)) + 1 <= {limit}",
         "message": f"spec.replicas: the groups' names '<metadata.name>-<index>' must be at most {limit} "
                    f"characters; shorten metadata.name or lower spec.replicas"},
    ]


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Nodes", "type": "integer", "jsonPath": ".spec.topology.nodes"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyNodes"},
    {"name": "Ready-Groups", "type": "integer", "jsonPath": ".status.readyGroups"},
    {"name": "Makespan(s)", "type": "number", "jsonPath": ".status.makespanSeconds"},
    {"name": "Recent-TTFT-p99(s)", "type": "number", "jsonPath": ".status.recentTtftP99Seconds"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": KIND.lower(), "kind": KIND, "shortNames": ["pdr"],
                      "categories": ["all"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                # `kubectl scale` and an HPA set spec.replicas (a fleet's groups, fleet.py)
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def render() -> str:
    header = "# Generated by `python -m pdrollout.operator.crd` from operator/models.py; do not edit.\n"
    # Through JSON: a schema reused in two places would otherwise print as YAML anchors.
    return header + yaml.safe_dump(json.loads(json.dumps(crd())), sort_keys=False, width=110)


if __name__ == "__main__":
    sys.stdout.write(render())
