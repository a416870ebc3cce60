"""JSON schema -> intermediate representation (IR): metaschema, normalization, the never-violate rule."""
