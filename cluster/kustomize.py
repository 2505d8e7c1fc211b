"""``kubectl kustomize DIR`` in Python, for exactly the kustomize features
deploy/kuberay/'s kustomizations use, so tests/unit/test_kuberay.py validates what an
operator's build gives without kubectl installed (and compares the two where it is).

Implemented, as kustomize v5 does them:
- ``resources``: a file (its YAML documents) inside the kustomization's directory, or a
  directory holding a kustomization (built the same way, recursively; a cycle fails).
- ``configMapGenerator``: ``name``, ``files`` (plain relative paths inside the
  directory: the key is the file's name, the value its UTF-8 text) and
  ``options.labels``, with ``generatorOptions.disableNameSuffixHash: true`` (the name
  hash is not implemented, so it is required).
- The output order: kustomize's ``legacy`` sort (what ``kubectl kustomize`` uses when
  a kustomization sets no ``sortOptions``): the kinds of its fixed list first, then by
  group, version and kind, then namespace and name. Two resources of one id fail.

Anything else (another field of a kustomization, a generator or its options, a URL, a
``List``, a file outside its kustomization's directory, a duplicate YAML key) raises
``Unsupported``: a feature this does not implement fails loudly, never ignored."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
API_VERSION = "kustomize.config.k8s.io/v1beta1"
FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions"}
GENERATOR_FIELDS = {"name", "files", "options"}
GENERATOR_OPTIONS = {"labels"}
GENERATOR_DEFAULTS = {"disableNameSuffixHash"}
CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # Kubernetes' IsConfigMapKey
# Labels and annotations kustomize reads and strips: a resource carrying one is not built as kustomize builds it.
KUSTOMIZE_ANNOTATIONS = ("config.kubernetes.io/", "internal.config.kubernetes.io/", "kustomize.config.k8s.io/")

# kustomize's legacy order (api/builtins' SortOrderTransformer: defaultOrderFirst, defaultOrderLast).
ORDER_FIRST = [
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "PodSecurityPolicy",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
TYPE_ORDERS = {
    **{kind: i - len(ORDER_FIRST) for i, kind in enumerate(ORDER_FIRST)},
    **{kind: 1 + i for i, kind in enumerate(ORDER_LAST)},
}


class Unsupported(ValueError):
    """A kustomization, or a resource, that this builder does not build as kustomize would."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key twice in a mapping (as kustomize's YAML parser does)."""


def _mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    keys = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<`: what it merges in, a key of the mapping may override
            continue
        key = loader.construct_object(key_node, deep=True)
        if key in keys:
            raise Unsupported(f"mapping key {key!r} defined twice{key_node.start_mark}")
        keys.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=_Loader) if doc is not None]


def build(directory: Path) -> list[dict[str, Any]]:
    """The resources ``kubectl kustomize directory`` prints, in its order."""
    resources = _accumulate(directory.resolve(), ())
    ids = set()
    for resource in resources:
        group, version, kind, namespace, name = _id(resource)
        key = (group, version, kind, namespace or "default", name)  # kustomize's ResId.Equals: "" is "default"
        if key in ids:
            raise Unsupported(f"two resources of one id {key} (kustomize refuses it): {directory}")
        ids.add(key)
    return sorted(resources, key=functools.cmp_to_key(_legacy_compare))


def _kustomization(directory: Path) -> dict[str, Any]:
    found = [directory / name for name in KUSTOMIZATION_FILES if (directory / name).is_file()]
    if len(found) != 1:
        raise Unsupported(f"{directory} holds {len(found)} kustomization files, not one: {found}")
    [path] = found
    documents = _documents(path)
    if len(documents) > 1 or documents and not isinstance(documents[0], dict):
        raise Unsupported(f"{path} is not one mapping")
    kustomization: dict[str, Any] = documents[0] if documents else {}
    unknown = set(kustomization) - FIELDS
    if unknown:
        raise Unsupported(f"{path}: kustomize fields not implemented: {sorted(unknown)}")
    if kustomization.get("apiVersion", API_VERSION) != API_VERSION:
        raise Unsupported(f"{path}: apiVersion {kustomization['apiVersion']!r} is not {API_VERSION}")
    if kustomization.get("kind", "Kustomization") != "Kustomization":
        raise Unsupported(f"{path}: kind {kustomization['kind']!r} (a Component?) is not implemented")
    return kustomization


def _inside(directory: Path, entry: object, what: str) -> Path:
    if not isinstance(entry, str) or "://" in entry or entry.startswith(("git@", "github.com/")):
        raise Unsupported(f"{directory}: {what} {entry!r} is not a local path")
    return (directory / entry).resolve()


def _accumulate(directory: Path, building: tuple[Path, ...]) -> list[dict[str, Any]]:
    """kustomize's AccumulateTarget for the features implemented: resources, then generators."""
    if directory in building:
        raise Unsupported(f"a cycle of kustomizations: {[*building, directory]}")
    kustomization = _kustomization(directory)
    resources: list[dict[str, Any]] = []
    for entry in kustomization.get("resources") or []:
        path = _inside(directory, entry, "resource")
        if path.is_dir():
            resources += _accumulate(path, (*building, directory))
        elif path.is_file():
            if not path.is_relative_to(directory):  # kustomize's default load restrictor: the root only
                raise Unsupported(f"{directory}: resource file {entry!r} is outside the kustomization's directory")
            resources += [_resource(doc, path) for doc in _documents(path)]
        else:
            raise Unsupported(f"{directory}: resource {entry!r} is neither a file nor a directory")
    generators = kustomization.get("configMapGenerator") or []
    if generators:
        defaults = kustomization.get("generatorOptions") or {}
        unknown = set(defaults) - GENERATOR_DEFAULTS
        if unknown or defaults.get("disableNameSuffixHash") is not True:
            raise Unsupported(
                f"{directory}: generatorOptions other than disableNameSuffixHash: true (the name hash) "
                f"are not implemented: {defaults}"
            )
    elif "generatorOptions" in kustomization:
        raise Unsupported(f"{directory}: generatorOptions without a generator")
    resources += [_config_map(directory, generator) for generator in generators]
    return resources


def _resource(doc: object, path: Path) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str) or not doc.get("apiVersion"):
        raise Unsupported(f"{path}: a document without apiVersion and kind: {doc!r:.200}")
    kind, metadata = doc["kind"], doc.get("metadata")
    if kind.endswith("List") or kind in ("Kustomization", "Component"):
        raise Unsupported(f"{path}: a {kind} is not implemented as a resource")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str) or not metadata["name"]:
        raise Unsupported(f"{path}: a {kind} without metadata.name")
    for field in ("labels", "annotations"):
        for key in metadata.get(field) or {}:
            if key.startswith(KUSTOMIZE_ANNOTATIONS):
                raise Unsupported(f"{path}: {kind} {metadata['name']}: kustomize's own {field[:-1]} {key}")
    return doc


def _config_map(directory: Path, generator: object) -> dict[str, Any]:
    if not isinstance(generator, dict):
        raise Unsupported(f"{directory}: a configMapGenerator entry that is not a mapping: {generator!r}")
    unknown = set(generator) - GENERATOR_FIELDS
    if unknown:
        raise Unsupported(f"{directory}: configMapGenerator fields not implemented: {sorted(unknown)}")
    name, files, options = generator.get("name"), generator.get("files"), generator.get("options") or {}
    if not isinstance(name, str) or not name or not files:
        raise Unsupported(f"{directory}: a configMapGenerator needs a name and files: {generator}")
    if set(options) - GENERATOR_OPTIONS:
        raise Unsupported(f"{directory}: configMapGenerator options not implemented: {sorted(options)}")
    data: dict[str, str] = {}
    for entry in files:
        if not isinstance(entry, str) or "=" in entry:
            raise Unsupported(f"{directory}: configMapGenerator file {entry!r}: only a plain path is implemented")
        path = _inside(directory, entry, "configMapGenerator file")
        if not path.is_relative_to(directory) or not path.is_file():
            raise Unsupported(f"{directory}: configMapGenerator file {entry!r} is not a file in the directory")
        if path.name in data or not CONFIG_MAP_KEY.match(path.name):
            raise Unsupported(f"{directory}: configMapGenerator key {path.name!r} is repeated or invalid")
        try:
            data[path.name] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:  # kustomize puts it in binaryData
            raise Unsupported(f"{path} is not UTF-8 text: binaryData is not implemented") from error
    metadata: dict[str, Any] = {"name": name}
    labels = options.get("labels")
    if labels:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise Unsupported(f"{directory}: configMapGenerator labels must be strings: {labels}")
        metadata["labels"] = dict(labels)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": dict(sorted(data.items()))}


def _gvk(resource: dict[str, Any]) -> tuple[str, str, str]:
    """kustomize's ParseGroupVersion: the group before the first slash, none without one."""
    api_version = str(resource["apiVersion"])
    group, _, version = api_version.partition("/") if "/" in api_version else ("", "", api_version)
    return group, version, resource["kind"]


def _id(resource: dict[str, Any]) -> tuple[str, str, str, str, str]:
    metadata = resource["metadata"]
    return (*_gvk(resource), metadata.get("namespace") or "", metadata["name"])


def _gvk_sort_string(gvk: tuple[str, str, str]) -> str:
    group, version, kind = gvk
    return "_".join([group or "~G", version or "~V", kind or "~K"])


def _legacy_compare(a: dict[str, Any], b: dict[str, Any]) -> int:
    """kustomize's legacyIDSorter.Less, as a comparison."""

    def less(x: dict[str, Any], y: dict[str, Any]) -> bool:
        gx, gy = _gvk(x), _gvk(y)
        if gx != gy:
            ox, oy = TYPE_ORDERS.get(gx[2], 0), TYPE_ORDERS.get(gy[2], 0)
            if ox != oy:
                return ox < oy
            if gx[2] == gy[2] == "Namespace" and (gx[0] == "" or gy[0] == ""):
                return _gvk_sort_string(gx) > _gvk_sort_string(gy)
            return _gvk_sort_string(gx) < _gvk_sort_string(gy)
        return _id_sort_string(x) < _id_sort_string(y)

    return -1 if less(a, b) else 1 if less(b, a) else 0


def _id_sort_string(resource: dict[str, Any]) -> str:
    group, version, kind, namespace, name = _id(resource)
    gvk = ".".join([kind or "[noKind]", version or "[noVer]", group or "[noGrp]"])  # Gvk.String()
    return "|".join([gvk, namespace or "~X", name or "~N"])
