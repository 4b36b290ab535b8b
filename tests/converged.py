"""The live objects of a rollout against what the pure builders say (fake-node and real-node tests)."""
from pdrollout.operator import builders
from pdrollout.operator.models import PDRolloutSpec
from chart_install import SYSTEM_NS, admin_token


def contains(actual, desired, at="") -> list[str]:
    """Where `actual` differs from `desired`, ignoring fields the API server added."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return [f"{at}: {actual!r} is not an object"]
        return [d for k, v in desired.items() for d in contains(actual.get(k), v, f"{at}.{k}")]
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return [f"{at}: {actual!r} != {desired!r}"]
        return [d for i, (a, v) in enumerate(zip(actual, desired)) for d in contains(a, v, f"{at}[{i}]")]
    return [] if actual == desired else [f"{at}: {actual!r} != {desired!r}"]


def assert_converged(cluster, ns, name):
    """The live objects are exactly what the pure builders say, owned by the PDRollout."""
    pdr = cluster.get("pdrollout", name, "-n", ns)
    spec = PDRolloutSpec.model_validate(pdr["spec"])
    for want in builders.desired_objects(name, ns, spec, admin_token(cluster, ns, name), SYSTEM_NS):
        kind, obj_name = want["kind"].lower(), want["metadata"]["name"]
        have = cluster.get(kind, obj_name, "-n", ns)
        diff = contains(have, {k: v for k, v in want.items() if k != "metadata"})
        assert not diff, f"{kind}/{obj_name} differs from the builders' output: {diff[:5]}"
        (ref,) = have["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("PDRollout", name,
                                                                             pdr["metadata"]["uid"], True)
