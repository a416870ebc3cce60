"""IR and patterns -> regex text (outlines-core syntax): builder, strings, numbers, whitespace."""
