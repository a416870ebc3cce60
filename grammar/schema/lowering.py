"""JSON schema -> IR: metaschema check, normalization, and the never-violate rule.

A schema is lowered as a *conjunction* of subschemas (`Sub`): `$ref` and `allOf` are
flattened into the conjunction (refs resolved with `referencing`, exactly as the
`jsonschema` validator resolves them), `anyOf` / `oneOf` / `if` split it into branches,
and the leaves are built per JSON type (grammar.schema.leaves / schema_object).
Every step may only *narrow* the set of generated instances; a construct that cannot be
enforced makes its subtree empty (None), which drops an optional member or a branch, and
is reported as `unsupported_json_schema` (naming keyword and JSON pointer) when it
empties the whole schema.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from grammar.errors import GrammarError, escape_pointer_token, pointer_str, unsupported
from grammar.schema.ir import Node, make_union
from grammar.schema.exclude import exclude
from grammar.schema.leaves import lower_leaf

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator

ROOT_URI = "urn:loraplex:schema"


@functools.lru_cache(maxsize=1)
def _meta_validator() -> "Draft202012Validator":
    """jsonschema is imported on first use: with its optional format packages installed, importing it costs
    seconds (rfc3987-syntax builds a parser), which a server that never sees a schema should not pay."""
    from jsonschema import Draft202012Validator  # jsonschema: seconds to import, kept off --help

    return Draft202012Validator(Draft202012Validator.META_SCHEMA)


def warm_validators() -> None:
    """Imports jsonschema and builds the meta-schema validator now (the server calls it off its event loop)."""
    _meta_validator()


@dataclass(frozen=True)
class SchemaOptions:
    """Limits and knobs of the schema -> regex lowering."""

    max_ref_depth: int = 3  # how often one $ref target may nest inside itself
    any_depth: int = 2  # container depth of values a schema leaves unconstrained
    # Larger maxLength (and longer bounded patterns) are lowered to this (a subset): every
    # counted character is a DFA state that the index scans the whole vocabulary from.
    max_string_length: int = 128
    max_counted_items: int = 10  # larger maxItems / maxProperties is lowered to this
    max_min_items: int = 64  # larger minItems / minLength is rejected
    max_enumeration: int = 2000  # multipleOf ranges up to this size are enumerated
    max_lowering_steps: int = 8_000  # the largest accepted bench schema needs ~6_400
    # subschemas being lowered inside one another (members, items, $ref, anyOf / oneOf / if branches): the bench's
    # deepest needs 19. Past it, a clear 400 instead of Python's recursion limit, which a chain of a few hundred
    # $defs reached wherever it happened to be, also inside the `referencing` library's Rust code (a panic).
    max_nesting: int = 64
    # Index build time and size grow with regex size x vocabulary size.  Above the
    # target, optional members / items / free-form values below `optional_depth` are
    # dropped (a subset), with decreasing depths until the regex fits (spec.py).
    target_regex_chars: int = 50_000
    max_regex_chars: int = 400_000
    optional_depth: int | None = None
    whitespace: str = r"[ ]?"

    @classmethod
    def for_vocab_size(cls, vocab_size: int, target_seconds: float = 2.0, **kwargs: Any) -> "SchemaOptions":
        """Options whose regex budget keeps a typical index build near `target_seconds`.

        Measured with outlines-core 0.2.14 on one core: ~5.5 us per regex char plus
        ~5 ns per regex char per vocabulary token.
        """
        per_char = 5.5e-6 + 5e-9 * vocab_size
        target = max(2_000, int(target_seconds / per_char))
        # a counted string costs ~0.4 s per 128 characters per 20k tokens
        max_string = max(32, min(256, int(128 * 32_000 / max(vocab_size, 1))))
        kwargs.setdefault("max_string_length", max_string)
        return cls(target_regex_chars=target, max_regex_chars=max(4 * target, 20_000), **kwargs)


@dataclass(frozen=True)
class Sub:
    """One conjunct: a subschema, the resolver for its refs, its JSON pointer.

    `skip`: keywords already handled (expanded or branched on).  `owners`: ids of the
    schemas whose in-place applicators ($ref, allOf, anyOf, ...) brought this one in, for
    `unevaluatedProperties`, which sees annotations of its own subtree only.
    """

    schema: Any
    resolver: Any
    pointer: str
    skip: frozenset[str] = field(default=frozenset())
    owners: tuple[int, ...] = ()

    def applicator(self, schema: Any, *path: str | int) -> "Sub":
        """A subschema applied in place (same instance location)."""
        return replace(self.child(schema, *path), owners=self.owners + (id(self.schema),))

    def child(self, schema: Any, *path: str | int) -> "Sub":
        """A subschema of a member / item (a new instance location)."""
        ptr = self.pointer + "".join("/" + escape_pointer_token(p) for p in path)
        resolver = self.resolver
        if isinstance(schema, dict) and isinstance(schema.get("$id"), str):
            try:
                resolver = resolver.in_subresource(DRAFT202012.create_resource(schema))
            except Exception:  # noqa: BLE001 - an odd $id: keep the enclosing base URI
                pass
        return Sub(schema, resolver, ptr)

    def has(self, keyword: str) -> bool:
        return isinstance(self.schema, dict) and keyword in self.schema and keyword not in self.skip


def check_metaschema(schema: Any) -> None:
    """Raise invalid_json_schema unless `schema` is a valid Draft 2020-12 schema."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("the schema must be a JSON object or a boolean", "invalid_json_schema")
    errors = sorted(_meta_validator().iter_errors(schema), key=lambda e: (len(e.absolute_path), str(e.message)))
    if errors:
        e = errors[0]
        ptr = "".join("/" + escape_pointer_token(p) for p in e.absolute_path)
        raise GrammarError(
            f"invalid JSON schema at '{pointer_str(ptr)}': {e.message[:300]}", "invalid_json_schema", pointer=ptr
        )


class Lowerer:
    """Lowers one root schema; holds the ref registry, validator cache and diagnostics."""

    def __init__(self, root: Any, options: SchemaOptions) -> None:
        self.options = options
        uri = root.get("$id") if isinstance(root, dict) and isinstance(root.get("$id"), str) else ROOT_URI
        uri = uri[:-1] if uri.endswith("#") else uri  # an empty fragment names the same resource
        try:
            self.registry = Registry().with_resource(uri, DRAFT202012.create_resource(root)).crawl()
        except Exception:  # noqa: BLE001 - e.g. a malformed embedded $id
            uri = ROOT_URI
            self.registry = Registry().with_resource(uri, DRAFT202012.create_resource(root))
        self.root = Sub(root, self.registry.resolver(base_uri=uri), "")
        self.reasons: list[GrammarError] = []
        self.unenforced: list[GrammarError] = []   # the reasons that mean "a keyword could not be enforced"
        self.depth = 0  # container nesting of the subschema being lowered
        self._active = 0  # lower() calls in progress (nesting of subschemas of any kind)
        self._steps = 0
        self._validators: dict[tuple[int, int], Draft202012Validator] = {}

    # -- entry point -------------------------------------------------------------------
    def lower_root(self) -> Node:
        node = self.lower([self.root], ())
        if node is None:
            if self.reasons:
                raise self.reasons[0]
            what = "is false" if self.root.schema is False else "admits no value that can be generated"
            raise GrammarError(f"the schema at '#' {what}", "unsupported_json_schema", pointer="#")
        return node

    @property
    def pruning(self) -> bool:
        """Below optional_depth only what the schema requires is generated."""
        return self.options.optional_depth is not None and self.depth >= self.options.optional_depth

    def lower_nested(self, conj: list[Sub], stack: tuple[int, ...]) -> Node | None:
        """lower() one container level deeper (member values, array items)."""
        self.depth += 1
        try:
            return self.lower(conj, stack)
        finally:
            self.depth -= 1

    def fail(self, keyword: str, pointer: str, detail: str = "", exact: bool = False) -> None:
        """Record why a subtree became empty; returns None for `return self.fail(...)`. `exact`: the subtree
        provably admits no value, or is cut by the documented recursion bound (not a keyword left unenforced)."""
        self.reasons.append(unsupported(keyword, pointer, detail))
        if not exact:
            self.unenforced.append(self.reasons[-1])
        return None

    # -- validation helpers ------------------------------------------------------------
    def valid(self, value: Any, subs: list[Sub]) -> bool:
        """Does `value` validate every conjunct (full schemas, formats asserted)?"""
        for sub in subs:
            key = (id(sub.schema), id(sub.resolver))
            validator = self._validators.get(key)
            if validator is None:
                from jsonschema import Draft202012Validator  # jsonschema: seconds to import, kept off --help

                validator = Draft202012Validator(
                    sub.schema,
                    registry=self.registry,
                    _resolver=sub.resolver,
                    format_checker=Draft202012Validator.FORMAT_CHECKER,
                )
                self._validators[key] = validator
            try:
                if not validator.is_valid(value):
                    return False
            except Exception:  # unresolvable refs, bad regexes: not provably valid
                return False
        return True

    # -- the conjunction walk ----------------------------------------------------------
    def expand(self, conj: list[Sub], stack: tuple[int, ...]) -> tuple[list[Sub], tuple[int, ...]] | None:
        """Flatten $ref and allOf into the conjunction; None if it is empty."""
        out: list[Sub] = []
        seen: set[tuple[int, frozenset[str]]] = set()
        work = list(conj)
        while work:
            sub = work.pop(0)
            schema = sub.schema
            if schema is True or schema == {}:
                continue
            if schema is False:
                return None
            if not isinstance(schema, dict):
                raise GrammarError(f"schema at '{pointer_str(sub.pointer)}' is not an object", "invalid_json_schema")
            if (id(schema), sub.skip) in seen:
                continue
            seen.add((id(schema), sub.skip))
            if sub.has("$dynamicRef"):
                return self.fail("$dynamicRef", sub.pointer)
            if sub.has("$ref"):
                ref = schema["$ref"]
                try:
                    target = sub.resolver.lookup(ref)
                except Unresolvable:
                    return self.fail("$ref", sub.pointer, f"cannot resolve {ref!r} (only local references)")
                if stack.count(id(target.contents)) >= self.options.max_ref_depth:
                    return self.fail("$ref", sub.pointer, f"recursion through {ref!r} is too deep", exact=True)
                stack = stack + (id(target.contents),)
                ptr = ref[1:] if ref.startswith("#") else ref
                work.append(Sub(target.contents, target.resolver, ptr, owners=sub.owners + (id(schema),)))
            if sub.has("allOf"):
                work.extend(sub.applicator(m, "allOf", i) for i, m in enumerate(schema["allOf"]))
            out.append(replace(sub, skip=sub.skip | {"$ref", "allOf"}))
        return out, stack

    def lower(self, conj: list[Sub], stack: tuple[int, ...]) -> Node | None:
        self._steps += 1
        if self._steps > self.options.max_lowering_steps:
            where = conj[0].pointer if conj else "#"
            raise GrammarError(f"the schema is too complex: lowering it needs more than "
                               f"{self.options.max_lowering_steps} steps (combinations of anyOf/oneOf/allOf/$ref); "
                               f"stopped at {where!r}", "unsupported_json_schema", pointer=where)
        if self._active >= self.options.max_nesting:
            where = pointer_str(conj[-1].pointer if conj else "")   # the newest conjunct: where it went deeper
            raise GrammarError(f"the schema nests more than {self.options.max_nesting} subschemas deep (members, "
                               f"items, $ref and anyOf / oneOf / if branches inside one another); stopped at "
                               f"'{where}'", "unsupported_json_schema", pointer=where)
        self._active += 1
        try:
            return self._lower(conj, stack)
        finally:
            self._active -= 1

    def _lower(self, conj: list[Sub], stack: tuple[int, ...]) -> Node | None:
        expanded = self.expand(conj, stack)
        if expanded is None:
            return None
        subs, stack = expanded
        for sub in subs:
            for keyword in ("anyOf", "oneOf", "if"):
                if sub.has(keyword):
                    return self._branch(subs, sub, keyword, stack)
        restart = self._apply_dependent_schemas(subs)
        if restart is not None:
            return self.lower(restart, stack)

        node = lower_leaf(self, subs, stack)
        for sub in subs:
            if node is not None and sub.has("not"):
                node = exclude(self, node, [sub.applicator(sub.schema["not"], "not")], stack)
                if node is None:
                    return self.fail("not", sub.pointer + "/not", "cannot prove generated values fail it")
        return node

    def _branch(self, subs: list[Sub], holder: Sub, keyword: str, stack: tuple[int, ...]) -> Node | None:
        rest = [replace(s, skip=s.skip | {keyword}) if s is holder else s for s in subs]
        schema = holder.schema
        num_unenforced = len(self.unenforced)   # none more by the end: every branch was provably empty (exact)
        if keyword == "if" and "then" not in schema and "else" not in schema:
            return self.lower(rest, stack)
        if keyword == "if":
            if_sub = holder.applicator(schema["if"], "if")
            then_sub = holder.applicator(schema.get("then", True), "then")
            else_sub = holder.applicator(schema.get("else", True), "else")
            yes = self._branch_member(rest + [if_sub, then_sub], stack)
            no = self._branch_member(rest + [else_sub], stack)
            if no is not None:
                no = exclude(self, no, [if_sub], stack)
            out = make_union([yes, no])
            return out if out is not None else self.fail("if", holder.pointer,
                                                         exact=len(self.unenforced) == num_unenforced)
        members = [holder.applicator(m, keyword, i) for i, m in enumerate(schema[keyword])]
        options: list[Node | None] = []
        for i, member in enumerate(members):
            node = self._branch_member(rest + [member], stack)
            if keyword == "oneOf":
                for j, other in enumerate(members):
                    if node is not None and j != i:
                        node = exclude(self, node, [other], stack)
                        if node is None:
                            self.fail("oneOf", member.pointer, f"cannot prove it excludes branch {j}")
            options.append(node)
        out = make_union(options)
        return out if out is not None else self.fail(keyword, holder.pointer,
                                                     exact=len(self.unenforced) == num_unenforced)

    def _branch_member(self, conj: list[Sub], stack: tuple[int, ...]) -> Node | None:
        """One branch of an anyOf / oneOf / if: None when no value satisfies it (it drops out of the union), but a
        branch with a keyword the compiler cannot enforce is rejected, as an optional property is, never silently
        left out of what can be generated (beside a null branch, the model could only ever write null)."""
        num_unenforced = len(self.unenforced)
        node = self.lower(conj, stack)
        if node is None and len(self.unenforced) > num_unenforced:
            raise self.unenforced[num_unenforced]
        return node

    def _apply_dependent_schemas(self, subs: list[Sub]) -> list[Sub] | None:
        """Merge dependentSchemas whose trigger property is required; None if none applies."""
        required = {r for s in subs if s.has("required") for r in s.schema["required"]}
        for idx, sub in enumerate(subs):
            for keyword in ("dependentSchemas", "dependencies"):
                deps = sub.schema.get(keyword) if sub.has(keyword) else None
                if not isinstance(deps, dict):
                    continue
                for trigger, dep in deps.items():
                    tag = f"{keyword}:{trigger}"
                    if isinstance(dep, list) or trigger not in required or tag in sub.skip:
                        continue
                    marked = replace(sub, skip=sub.skip | {tag})
                    return subs[:idx] + [marked] + subs[idx + 1 :] + [sub.applicator(dep, keyword, trigger)]
        return None
