"""Context-free grammars (GBNF) compiled by xgrammar: the grammar, its worker side, the emptiness check."""
