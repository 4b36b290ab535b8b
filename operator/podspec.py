"""The spec's pod-level parts beyond the engine's own: where the model comes from, how the engine is
sized, how long it may take to start and to drain, and a full pod template merged under the
operator's fields. Models only (the CRD schema comes from them); podtemplate.py and storage.py render."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

ENGINE_CONTAINER = "engine"
MAX_ITEMS = 64
QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"   # a Kubernetes resource quantity
_PASS = {"x-kubernetes-preserve-unknown-fields": True}   # checked by the API server on the StatefulSet


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


def _rules(*rules: tuple[str, str]) -> dict:
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


# --- model sources ------------------------------------------------------------------------------
class PVCSource(_Model):
    claim_name: str = Field(min_length=1, max_length=253)
    sub_path: str | None = Field(default=None, min_length=1, max_length=4096,
                                 description="The model directory inside the volume (default: its root).")


class HostPathSource(_Model):
    path: str = Field(min_length=1, max_length=4096, pattern="^/", description="The model directory on the node.")


class ImageSource(_Model):
    reference: str = Field(min_length=1, max_length=1024, description="An OCI image (or artifact) holding "
                                                                       "the model at its root (ImageVolume, Kubernetes 1.31+).")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class CacheSource(_Model):
    """An init container copies the model from a PVC path to a node-local directory once; later pods on
    that node find it complete (a marker file written last) and start without copying."""
    pvc: PVCSource
    host_path: str | None = Field(default=None, max_length=4096, pattern="^/", description=(
        "Node-local cache directory (writable by the engine's user); unset: an emptyDir (per pod)."))


_ONE_SOURCE = "model.source sets exactly one of pvc, hostPath, image, cache"


class ModelSource(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(
        ("[has(self.pvc), has(self.hostPath), has(self.image), has(self.cache)].filter(x, x).size() == 1",
         _ONE_SOURCE)))

    pvc: PVCSource | None = None
    host_path: HostPathSource | None = None
    image: ImageSource | None = None
    cache: CacheSource | None = None

    @model_validator(mode="after")
    def _one(self) -> "ModelSource":  # mirrors the CEL rule
        if sum(x is not None for x in (self.pvc, self.host_path, self.image, self.cache)) != 1:
            raise ValueError(_ONE_SOURCE)
        return self


# --- engine sizing --------------------------------------------------------------------------------
class EngineSizing(_Model):
    """Start-time sizes of the engine (EngineConfig fields); unset: the engine's defaults. The prefill
    budget is spec.multiplexing.prefillBudgetTokens (live, through /control)."""
    max_running: int | None = Field(default=None, ge=1, description="Decode rows running at once.")
    max_context_len: int | None = Field(default=None, ge=1, description="Longest sequence (prompt + output); "
                                                                         "unset: the model's.")
    mem_fraction: float | None = Field(default=None, ge=0.05, le=0.98, description=(
        "Share of the GPU memory left after weights that the KV cache takes; unset: the engine's."))

    def engine_fields(self) -> dict:
        out = {"max_running": self.max_running, "max_context_len": self.max_context_len,
               "kv_mem_fraction": self.mem_fraction}
        return {k: v for k, v in out.items() if v is not None}


# --- start, liveness, drain -----------------------------------------------------------------------
class Lifecycle(_Model):
    startup_seconds: int = Field(default=1800, ge=10, description=(
        "How long an engine may take to load before the kubelet restarts it (the startup probe's budget)."))
    liveness_seconds: int = Field(default=60, ge=10, description=(
        "How long the engine's step loop may be silent (GET /live 503) before the kubelet restarts it."))
    drain_seconds: int = Field(default=30, ge=0, le=3600, description=(
        "On stop, in-flight requests may finish for this long before they are aborted; the grace period "
        "is derived from it."))


# --- the full pod template ------------------------------------------------------------------------
_OWNED_CTR = ("command", "args", "image")
_OWNED_MSG = ("podTemplate.spec.containers[name=engine] may not set command, args or image "
              "(the operator's: spec.image and the engine's own command)")


class _Named(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow",
                              json_schema_extra=_PASS)
    name: str = Field(min_length=1, max_length=253)


class EnvVar(_Named):
    pass


class Mount(_Named):
    mount_path: str = Field(min_length=1, max_length=4096)


class Container(_Named):
    """A sidecar, an init container, or (named `engine`) additions to the operator's engine container."""
    model_config = ConfigDict(json_schema_extra={**_PASS, **_rules(
        (f"self.name != '{ENGINE_CONTAINER}' || " + " && ".join(f"!has(self.{f})" for f in _OWNED_CTR),
         _OWNED_MSG))})
    command: list[str] | None = Field(default=None, max_length=MAX_ITEMS)
    args: list[str] | None = Field(default=None, max_length=1024)
    image: str | None = Field(default=None, max_length=1024)
    env: list[EnvVar] = Field(default=[], max_length=MAX_ITEMS)
    volume_mounts: list[Mount] = Field(default=[], max_length=MAX_ITEMS)


class PodSpecOverlay(BaseModel):
    """A PodSpec as written (runtimeClassName, schedulerName, securityContext, initContainers, sidecars,
    volumes, ...): the operator's fields are merged over it, its owned names are refused."""
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow",
                              json_schema_extra=_PASS)
    containers: list[Container] = Field(default=[], max_length=16)
    init_containers: list[Container] = Field(default=[], max_length=16)
    volumes: list[_Named] = Field(default=[], max_length=MAX_ITEMS)


class PodMetadata(_Model):
    labels: dict[str, str] = Field(default={})
    annotations: dict[str, str] = Field(default={})


class PodTemplateSpec(_Model):
    metadata: PodMetadata = Field(default_factory=PodMetadata)
    spec: PodSpecOverlay = Field(default_factory=PodSpecOverlay)

    @model_validator(mode="after")
    def _owned(self) -> "PodTemplateSpec":  # mirrors the CEL rule on Container
        for c in self.spec.containers:
            if c.name == ENGINE_CONTAINER and any(getattr(c, f) is not None for f in _OWNED_CTR):
                raise ValueError(_OWNED_MSG)
        return self
