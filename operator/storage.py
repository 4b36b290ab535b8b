"""spec.model.source -> the volume mounted at model.path, and for a node-local cache the init container
that fills it. Pure: what the pod template gains."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdrollout.operator.podspec import ModelSource

MODEL_VOLUME = "pdrollout-model"
SOURCE_VOLUME = "pdrollout-model-src"     # the PVC a cache is filled from
CACHE_INIT = "model-cache"
SOURCE_DIR = "/pdrollout/source"
CACHE_DIR = "/pdrollout/cache"
COMPLETE = ".pdrollout-complete"          # written last: a cache without it is refilled

# Copy into a fresh directory, then rename: a fill cut short (pod deleted, node rebooted) leaves no
# directory that looks complete, and two pods on one node never read a half-written model.
_FILL = f"""set -eu
if [ -f {CACHE_DIR}/{COMPLETE} ]; then echo "model cache complete: $MODEL_CACHE"; exit 0; fi
if [ ! -r {SOURCE_DIR} ] || [ -z "$(ls -A {SOURCE_DIR} 2>/dev/null)" ]; then
  msg="model source $MODEL_SOURCE is missing, empty or unreadable"
  echo "$msg" >&2; echo "$msg" 2>/dev/null >/dev/termination-log || true; exit 2; fi
tmp={CACHE_DIR}/.fill-$$; rm -rf "$tmp"; mkdir -p "$tmp"
cp -R {SOURCE_DIR}/. "$tmp"/
for f in "$tmp"/* "$tmp"/.[!.]*; do [ -e "$f" ] || continue; rm -rf {CACHE_DIR}/"${{f##*/}}"; mv "$f" {CACHE_DIR}/; done
rmdir "$tmp"; touch {CACHE_DIR}/{COMPLETE}; echo "model cache filled: $MODEL_CACHE"
"""


@dataclass
class ModelStorage:
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)        # the engine container's
    init_containers: list[dict] = field(default_factory=list)


def _pvc(claim: str) -> dict:
    return {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}


def _sub(sub_path: str | None) -> dict:
    return {"subPath": sub_path} if sub_path else {}


def describe(source: ModelSource | None) -> str:
    """Where the model comes from, for messages: the path a person can go and check."""
    if source is None:
        return "the image"
    if source.pvc:
        return f"PVC {source.pvc.claim_name}" + (f" path {source.pvc.sub_path}" if source.pvc.sub_path else "")
    if source.host_path:
        return f"hostPath {source.host_path.path}"
    if source.image:
        return f"image {source.image.reference}"
    c = source.cache
    return (f"PVC {c.pvc.claim_name}" + (f" path {c.pvc.sub_path}" if c.pvc.sub_path else "")
            + f" cached at {c.host_path or 'an emptyDir'}")


def model_storage(source: ModelSource | None, model_path: str, image: str, security: dict,
                  resources: dict) -> ModelStorage:
    """The engine reads the model at model_path: the source is mounted there read-only."""
    out = ModelStorage()
    if source is None:
        return out
    mount = {"name": MODEL_VOLUME, "mountPath": model_path, "readOnly": True}
    if source.pvc:
        out.volumes.append({"name": MODEL_VOLUME, **_pvc(source.pvc.claim_name)})
        out.mounts.append({**mount, **_sub(source.pvc.sub_path)})
    elif source.host_path:
        # Directory: the kubelet refuses to start the pod when it is absent (no empty dir made for it).
        out.volumes.append({"name": MODEL_VOLUME, "hostPath": {"path": source.host_path.path, "type": "Directory"}})
        out.mounts.append(mount)
    elif source.image:
        out.volumes.append({"name": MODEL_VOLUME, "image": {"reference": source.image.reference,
                                                             "pullPolicy": source.image.pull_policy}})
        out.mounts.append(mount)
    else:
        c = source.cache
        cache = ({"hostPath": {"path": c.host_path, "type": "DirectoryOrCreate"}} if c.host_path
                 else {"emptyDir": {}})
        out.volumes += [{"name": MODEL_VOLUME, **cache}, {"name": SOURCE_VOLUME, **_pvc(c.pvc.claim_name)}]
        out.mounts.append(mount)
        out.init_containers.append({
            "name": CACHE_INIT, "image": image, "command": ["sh", "-c", _FILL],
            "env": [{"name": "MODEL_SOURCE", "value": describe(source).split(" cached at ")[0]},
                    {"name": "MODEL_CACHE", "value": c.host_path or "emptyDir"}],
            "volumeMounts": [{"name": SOURCE_VOLUME, "mountPath": SOURCE_DIR, "readOnly": True,
                              **_sub(c.pvc.sub_path)},
                             {"name": MODEL_VOLUME, "mountPath": CACHE_DIR}],
            "securityContext": security, "resources": resources,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        })
    return out
