"""The spec expression language: source text -> AST (parser) -> typed IR (typecheck)."""
