"""The YAML loader of config files: PyYAML's safe loader, refusing a key given twice in one mapping.

It reads booleans and numbers as YAML 1.2 does (``lorafusion_sched.jobs_syntax.read_yaml_12_scalars``):
a leading zero is decimal (``global_batch_size: 016`` was octal, 14), ``1:30`` is text (it was 90),
``1e-4`` and ``2.0e4`` are numbers (they were text), and only ``true`` and ``false`` are booleans:
a job named ``no`` is text (it was ``false``, refused as not a string); a switch still takes ``yes``
or ``off``, which the config's models read as ``true`` and ``false``.
"""

from __future__ import annotations

from typing import Any

import yaml

from lorafusion_megatron.errors import TrainerError
from lorafusion_sched.jobs_syntax import read_yaml_12_scalars

__all__ = ["UniqueKeyLoader"]

_MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"
_STR_TAG = "tag:yaml.org,2002:str"


class UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a key given twice in one mapping (PyYAML keeps the last silently).

    Keys merged in with ``<<: *anchor`` are not the mapping's own: a key written beside the merge
    overrides the anchor's, as YAML's merge key specifies (a job's own ``r`` over a shared default).
    """

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """YAML's merge key, each key kept once: the mapping's own, else the first merged mapping's.

        PyYAML's own keeps merged keys beside the keys that override them and tells keys apart by
        object identity, so an override inside a merged anchor (``x-big: {<<: *small, r: 64}``)
        could lose to the inner anchor's value, or read here as a key given twice.
        """
        own: list[tuple[yaml.Node, yaml.Node]] = []
        merged: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                if key_node.tag == _VALUE_TAG:  # the `=` key, read as a string (as PyYAML does)
                    key_node.tag = _STR_TAG
                own.append((key_node, value_node))
                continue
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"expected a mapping or list of mappings for merging, but found {source.id}",
                        source.start_mark,
                    )
                self.flatten_mapping(source)
                merged.extend(source.value)
        seen = {_key_identity(key) for key, _ in own}
        kept = []
        for pair in merged:
            if (identity := _key_identity(pair[0])) not in seen:
                seen.add(identity)
                kept.append(pair)
        node.value = kept + own

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """PyYAML's mapping, after checking that no key of the mapping's own is given twice.

        Raises:
            TrainerError: naming the line of the second occurrence.
        """
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise TrainerError(f"line {key_node.start_mark.line + 1}: key {key!r} appears twice in one mapping")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


read_yaml_12_scalars(UniqueKeyLoader)


def _key_identity(key: yaml.Node) -> object:
    """What makes two mapping keys the same key: a scalar's tag and text, another node itself."""
    return (key.tag, key.value) if isinstance(key, yaml.ScalarNode) else id(key)
