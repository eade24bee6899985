"""The compile cache shared by processes: one service's compilation is loaded, not compiled, by another."""

from __future__ import annotations

from grammar_helpers import SMOLLM2_VOCAB
from loraplex.grammar.backends.disk_cache import GrammarDiskCache
from loraplex.grammar.compiler import GrammarCompilerService, GrammarLimits
from loraplex.grammar.spec import GrammarKind, GrammarSpec
from loraplex.platform.grammar_wire import SpecGrammarCodec
from loraplex.platform.structured import GRAMMAR_RELAXED_HEADER, relaxation_headers

SPEC = GrammarSpec(GrammarKind.EBNF, 'root ::= "yes" | "no" | "maybe " [0-9]+')


def accepts(grammar, tokenizer, text: str) -> bool:
    matcher = grammar.new_matcher()
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_completed()


def test_a_grammar_compiled_by_one_process_is_loaded_by_another(tokenizer, tmp_path):
    first = GrammarCompilerService(tokenizer, SMOLLM2_VOCAB, GrammarLimits(cache_dir=str(tmp_path)))
    second = GrammarCompilerService(tokenizer, SMOLLM2_VOCAB, GrammarLimits(cache_dir=str(tmp_path)))
    try:
        first.compile_blocking(SPEC)
        assert first.backends["xgrammar"].context.disk_cache.num_stored == 1
        assert [p.suffix for p in tmp_path.iterdir()] == [".json"]  # one entry, no temporary file left
        grammar = second.compile_blocking(SPEC)
        cache = second.backends["xgrammar"].context.disk_cache
        assert cache.num_hits == 1 and cache.num_stored == 0  # loaded, not compiled
        assert accepts(grammar, tokenizer, "maybe 42") and not accepts(grammar, tokenizer, "nope")
    finally:
        first.close()
        second.close()


def test_a_damaged_entry_is_a_miss_and_is_rewritten(tokenizer, tmp_path):
    warm = GrammarCompilerService(tokenizer, SMOLLM2_VOCAB, GrammarLimits(cache_dir=str(tmp_path)))
    try:
        warm.compile_blocking(SPEC)
    finally:
        warm.close()
    (entry,) = tmp_path.iterdir()
    entry.write_text("{not json")
    service = GrammarCompilerService(tokenizer, SMOLLM2_VOCAB, GrammarLimits(cache_dir=str(tmp_path)))
    try:
        grammar = service.compile_blocking(SPEC)
        assert accepts(grammar, tokenizer, "yes")
        assert service.backends["xgrammar"].context.disk_cache.num_stored == 1
        assert entry.read_text() != "{not json"
    finally:
        service.close()


def test_keys_separate_their_parts():
    assert GrammarDiskCache.key("ab", "c") != GrammarDiskCache.key("a", "bc")


def test_strict_crosses_to_the_engine_core(compiler):
    codec = SpecGrammarCodec(compiler)
    schema = {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True}
    relaxed = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, schema, strict=False))
    decoded = codec.decode(codec.encode(relaxed), None)
    assert decoded.spec.strict is False and decoded.relaxed and "uniqueItems" in decoded.relaxed
    exact = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    strict = compiler.compile_blocking(GrammarSpec(GrammarKind.JSON_SCHEMA, exact, strict=True))
    decoded = codec.decode(codec.encode(strict), None)
    assert decoded.spec.strict is True and decoded is strict  # the same cache entry: the same spec


def test_a_relaxed_grammar_is_documented_in_a_response_header():
    assert relaxation_headers({}) == {}
    headers = relaxation_headers({"grammar_relaxed": "keyword 'uniqueItems' at # is not supported"})
    assert headers == {GRAMMAR_RELAXED_HEADER: "keyword 'uniqueItems' at # is not supported"}
