"""The engine pod as the operator's builders render it for each example and each model source: volumes,
probes, grace, preStop, the full pod template merged under the operator's fields, owned fields refused,
engine sizing in the engine's config; and a config-code exit read back into a ConfigError condition."""
import json
import math
from pathlib import Path

import pydantic
import pytest
import yaml

from pdrollout.engine.protocol.config import EngineConfig
from pdrollout.engine.protocol.exits import EXIT_CONFIG
from pdrollout.engine.protocol.shutdown import ABORT_WAIT_S, stop_bound_s
from pdrollout.operator import builders, group, storage
from pdrollout.operator import status as st
from pdrollout.operator.models import PDRolloutSpec, Phase

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.yaml"))


def doc_of(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())["spec"]


def spec_with(path: str, **changes) -> PDRolloutSpec:
    return PDRolloutSpec.model_validate({**doc_of(path), **changes})


def engine_of(tpl: dict) -> dict:
    return next(c for c in tpl["spec"]["containers"] if c["name"] == builders.ENGINE_CONTAINER)


@pytest.mark.parametrize("path", EXAMPLES)
def test_every_example_renders_probes_grace_prestop_and_its_model_volume(path):
    spec = spec_with(path)
    tpl = builders.pod_template("r", "ns", spec)
    pod, engine = tpl["spec"], engine_of(tpl)
    lc = spec.lifecycle
    # Startup: /health (loaded and joined) gets at least startupSeconds before the kubelet gives up.
    sp = engine["startupProbe"]
    assert sp["httpGet"] == {"path": "/health", "port": "http"}
    assert lc.startup_seconds <= sp["periodSeconds"] * sp["failureThreshold"] < lc.startup_seconds + sp["periodSeconds"]
    # Liveness: the engine loop's heartbeat with the spec's bound; readiness stays /health.
    assert engine["livenessProbe"]["httpGet"] == {"path": f"/live?bound_s={lc.liveness_seconds}", "port": "http"}
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    # The engine drains for drainSeconds (its flag), then aborts; the grace period covers all of its stop.
    args = engine["args"]
    assert float(args[args.index("--drain-timeout") + 1]) == lc.drain_seconds
    grace = pod["terminationGracePeriodSeconds"]
    assert grace == math.ceil(stop_bound_s(lc.drain_seconds)) and grace >= lc.drain_seconds + ABORT_WAIT_S
    hook = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:4] == ["python3", "-m", "pdrollout.engine.server.lifecycle", "drain"]
    assert hook[hook.index("--port") + 1] == str(spec.port)
    assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # The model: mounted read-only at model.path from its source, or baked into the image.
    mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    if spec.model.source is None:
        assert spec.model.path not in mounts and storage.MODEL_VOLUME not in volumes
    else:
        m = mounts[spec.model.path]
        assert m["name"] == storage.MODEL_VOLUME and m["readOnly"] is True
        assert storage.MODEL_VOLUME in volumes
    # The engine reads what the ConfigMap says: the sizing fields are the engine's own.
    cfg = json.loads(builders.configmap("r", "ns", spec)["data"][builders.ENGINE_CONFIG_KEY])
    EngineConfig.model_validate({"model": spec.model.path, **cfg})
    for key, value in spec.engine.engine_fields().items():
        assert cfg[key] == value


def test_the_shipped_gpu_examples_carry_their_model_source():
    one = builders.pod_template("r", "ns", spec_with("examples/pdrollout.yaml"))
    assert {"name": storage.MODEL_VOLUME, "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} \
        in one["spec"]["volumes"]
    assert {"name": storage.MODEL_VOLUME, "mountPath": "/models/Qwen3-30B-A3B", "readOnly": True,
            "subPath": "Qwen3-30B-A3B"} in engine_of(one)["volumeMounts"]
    two = builders.pod_template("r", "ns", spec_with("examples/pdrollout-2node.yaml"))
    (fill,) = two["spec"]["initContainers"]
    assert fill["name"] == storage.CACHE_INIT and fill["image"] == engine_of(two)["image"]
    # It copies files: the engine's CPU and memory, none of its GPUs or RDMA devices.
    limits = engine_of(two)["resources"]["limits"]
    assert "nvidia.com/gpu" in limits and fill["resources"]["limits"] == {"cpu": limits["cpu"],
                                                                          "memory": limits["memory"]}
    assert {"name": storage.SOURCE_VOLUME, "mountPath": storage.SOURCE_DIR, "readOnly": True,
            "subPath": "Qwen3-235B-A22B"} in fill["volumeMounts"]
    cache = next(v for v in two["spec"]["volumes"] if v["name"] == storage.MODEL_VOLUME)
    assert cache["hostPath"] == {"path": "/var/cache/pdrollout/Qwen3-235B-A22B", "type": "DirectoryOrCreate"}
    assert two["metadata"]["labels"]["team"] == "rl"     # its template's metadata


@pytest.mark.parametrize("source, volume", [
    ({"pvc": {"claimName": "weights"}}, {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}),
    ({"hostPath": {"path": "/data/tiny"}}, {"hostPath": {"path": "/data/tiny", "type": "Directory"}}),
    ({"image": {"reference": "registry.local/models/tiny:1"}},
     {"image": {"reference": "registry.local/models/tiny:1", "pullPolicy": "IfNotPresent"}}),
    ({"cache": {"pvc": {"claimName": "weights", "subPath": "tiny"}}}, {"emptyDir": {}}),
])
def test_each_model_source_kind(source, volume):
    doc = doc_of("examples/pdrollout-cpu.yaml")
    spec = PDRolloutSpec.model_validate({**doc, "model": {**doc["model"], "source": source}})
    tpl = builders.pod_template("r", "ns", spec)
    assert {"name": storage.MODEL_VOLUME, **volume} in tpl["spec"]["volumes"]
    inits = tpl["spec"].get("initContainers", [])
    if "cache" in source:
        (fill,) = inits
        # The fill runs as the engine does (the CPU pod's non-root user) and fails with the config code.
        assert fill["securityContext"] == engine_of(tpl)["securityContext"]
        assert f"exit {EXIT_CONFIG}" in fill["command"][-1]
        assert {"name": storage.SOURCE_VOLUME, "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} \
            in tpl["spec"]["volumes"]
    else:
        assert not inits
    # A source change is a template change: the group is recreated on it.
    assert builders.template_hash("r", "ns", spec) != builders.template_hash("r", "ns", spec_with(
        "examples/pdrollout-cpu.yaml"))


def test_model_source_sets_exactly_one_kind():
    doc = doc_of("examples/pdrollout-cpu.yaml")
    for source in ({}, {"pvc": {"claimName": "a"}, "hostPath": {"path": "/x"}}):
        with pytest.raises(pydantic.ValidationError, match="model.source sets exactly one of"):
            PDRolloutSpec.model_validate({**doc, "model": {**doc["model"], "source": source}})


TEMPLATE = {
    "metadata": {"labels": {"team": "rl", builders.LABEL_ROLLOUT: "someone-else"},
                 "annotations": {"sidecar.istio.io/inject": "false"}},
    "spec": {
        "runtimeClassName": "nvidia",
        "schedulerName": "volcano",
        "hostIPC": True,
        "securityContext": {"supplementalGroups": [1000], "seccompProfile": {"type": "Unconfined"}},
        "tolerations": [{"key": "rl", "operator": "Exists"}],
        "initContainers": [{"name": "warm", "image": "busybox", "command": ["true"]}],
        "containers": [
            {"name": "engine", "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
             "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
             "resources": {"limits": {"example.com/fpga": "1"}}},
            {"name": "log-shipper", "image": "fluent/fluent-bit:3", "args": ["-c", "/etc/fb.conf"]},
        ],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
    },
}


def test_full_pod_template_merges_under_the_operators_fields():
    base = spec_with("examples/pdrollout.yaml")
    plain = builders.pod_template("r", "ns", base)
    doc = {**doc_of("examples/pdrollout.yaml"), "podTemplate": {"template": TEMPLATE}}
    tpl = builders.pod_template("r", "ns", PDRolloutSpec.model_validate(doc))
    pod, engine, ours = tpl["spec"], engine_of(tpl), engine_of(plain)
    # The user's fields the operator does not set arrive as written.
    assert pod["runtimeClassName"] == "nvidia" and pod["schedulerName"] == "volcano" and pod["hostIPC"] is True
    assert tpl["metadata"]["labels"]["team"] == "rl"
    assert tpl["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert pod["securityContext"]["supplementalGroups"] == [1000]
    assert pod["initContainers"] == TEMPLATE["spec"]["initContainers"]
    assert pod["containers"][1] == TEMPLATE["spec"]["containers"][1]          # the sidecar, after the engine
    assert pod["tolerations"] == plain["spec"]["tolerations"] + TEMPLATE["spec"]["tolerations"]
    assert pod["volumes"] == plain["spec"]["volumes"] + TEMPLATE["spec"]["volumes"]
    # ... and the operator's win: its labels, its seccomp profile, its engine container.
    assert tpl["metadata"]["labels"][builders.LABEL_ROLLOUT] == "r"
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for key in ("command", "args", "image", "startupProbe", "livenessProbe", "readinessProbe", "lifecycle"):
        assert engine[key] == ours[key], key
    assert engine["env"] == ours["env"] + TEMPLATE["spec"]["containers"][0]["env"]
    assert engine["volumeMounts"] == ours["volumeMounts"] + TEMPLATE["spec"]["containers"][0]["volumeMounts"]
    assert engine["resources"]["limits"] == {**ours["resources"]["limits"], "example.com/fpga": "1"}
    assert engine["resources"]["requests"] == ours["resources"]["requests"]
    assert pod["terminationGracePeriodSeconds"] == plain["spec"]["terminationGracePeriodSeconds"]
    # Gang scheduling names its scheduler over the template's.
    gang = builders.pod_template("r", "ns", PDRolloutSpec.model_validate({**doc, "gang": {}}))
    assert gang["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    # An empty template changes nothing.
    empty = {**doc_of("examples/pdrollout.yaml"), "podTemplate": {"template": {}}}
    assert builders.pod_template("r", "ns", PDRolloutSpec.model_validate(empty)) == plain


@pytest.mark.parametrize("engine, field", [
    ({"name": "engine", "command": ["sleep", "infinity"]}, "containers[name=engine] may not set command"),
    ({"name": "engine", "args": ["serve"]}, "containers[name=engine] may not set command, args or image"),
    ({"name": "engine", "image": "mine:1"}, "containers[name=engine] may not set command, args or image"),
    ({"name": "engine", "env": [{"name": "PDROLLOUT_NODE_RANK", "value": "1"}]},
     "containers[name=engine] may not set the env"),
    ({"name": "engine", "env": [{"name": "NCCL_IB_HCA", "value": "mlx5_9"}]},
     "containers[name=engine] may not set the env"),
    ({"name": "engine", "volumeMounts": [{"name": "x", "mountPath": "/etc/pdrollout"}]},
     "nor mount at /dev/shm, /etc/pdrollout"),
])
def test_owned_engine_fields_are_refused_naming_the_field(engine, field):
    doc = {**doc_of("examples/pdrollout.yaml"), "podTemplate": {"template": {"spec": {"containers": [engine]}}}}
    with pytest.raises(pydantic.ValidationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        PDRolloutSpec.model_validate(doc)
    # The same fields on a sidecar are its own business.
    side = {**engine, "name": "sidecar"}
    ok = {**doc_of("examples/pdrollout.yaml"), "podTemplate": {"template": {"spec": {"containers": [side]}}}}
    PDRolloutSpec.model_validate(ok)


def test_model_volume_name_is_refused_in_the_template():
    doc = {**doc_of("examples/pdrollout.yaml"),
           "podTemplate": {"template": {"spec": {"volumes": [{"name": storage.MODEL_VOLUME, "emptyDir": {}}]}}}}
    with pytest.raises(pydantic.ValidationError, match="podTemplate.template.spec.volumes may not use the names"):
        PDRolloutSpec.model_validate(doc)


def test_engine_sizing_reaches_the_engine_config_only_when_set():
    plain = spec_with("examples/pdrollout-cpu.yaml")
    cfg = json.loads(builders.configmap("r", "ns", plain)["data"][builders.ENGINE_CONFIG_KEY])
    assert not {"max_running", "max_context_len", "kv_mem_fraction"} & set(cfg)
    sized = spec_with("examples/pdrollout-cpu.yaml", engine={"maxRunning": 7, "maxContextLen": 512,
                                                             "memFraction": 0.8})
    cfg = json.loads(builders.configmap("r", "ns", sized)["data"][builders.ENGINE_CONFIG_KEY])
    assert (cfg["max_running"], cfg["max_context_len"], cfg["kv_mem_fraction"]) == (7, 512, 0.8)
    known = {k: v for k, v in cfg.items() if k in EngineConfig.model_fields}
    c = EngineConfig.model_validate({"model": sized.model.path, **known})
    assert (c.max_running, c.max_context_len) == (7, 512)
    # Read at start: a change recreates the group; the prefill budget is the live control's.
    assert builders.template_hash("r", "ns", sized) != builders.template_hash("r", "ns", plain)
    assert cfg["control"]["prefill_budget_tokens"] == sized.multiplexing.prefill_budget_tokens


def _pod(name: str, key: str, cs: dict) -> dict:
    return {"metadata": {"name": name, "uid": f"uid-{name}"}, "status": {"phase": "Running", key: [cs]}}


MISSING = ("...\npdrollout serve: exit 2 (bad configuration): engine failed to load (bad configuration): "
           "ConfigError: /models/tiny/config.json not found: a model directory needs config.json + *.safetensors\n")


def test_a_config_exit_becomes_a_condition_with_the_engines_words():
    engine = {"name": "engine", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
              "lastState": {"terminated": {"exitCode": EXIT_CONFIG, "message": MISSING}}}
    said = group.config_exit([_pod("r-0", "containerStatuses", engine)])
    assert said.startswith(f"container engine of pod r-0 exited with the config code {EXIT_CONFIG}: ")
    assert "/models/tiny/config.json not found" in said
    fill = {"name": storage.CACHE_INIT, "state": {"terminated": {"exitCode": EXIT_CONFIG,
                                                                  "message": "model source PVC w path tiny is missing"}}}
    assert "init container model-cache of pod r-1" in group.config_exit([_pod("r-1", "initContainerStatuses", fill)])
    other = {**engine, "lastState": {"terminated": {"exitCode": 3, "message": "stall"}}}
    assert group.config_exit([_pod("r-0", "containerStatuses", other)]) is None
    # In status: True with those words, kept through the restarts, cleared once the group runs.
    obs = st.Observation(desired_nodes=2, ready_nodes=0, generation=1, observed_generation=1,
                         restarting="container engine of pod r-0 restarted", config_error=said)
    phase, conds = st.decide(obs)
    (c,) = [x for x in conds if x.type.value == "ConfigError"]
    assert (c.status, c.reason, c.message) == ("True", "EngineConfigExit", said)
    prev = c.model_dump(by_alias=True, mode="json")
    phase, conds = st.decide(st.Observation(desired_nodes=2, ready_nodes=1, generation=1, observed_generation=1,
                                            previous_config=prev))
    assert phase is Phase.STARTING and next(x for x in conds if x.type.value == "ConfigError").message == said
    # Never there: no ConfigError condition at all.
    assert not [x for x in st.decide(st.Observation(desired_nodes=2, ready_nodes=0, generation=1,
                                                    observed_generation=1))[1] if x.type.value == "ConfigError"]
