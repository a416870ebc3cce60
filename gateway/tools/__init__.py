"""Function calling: tools in the prompt, the tool-call constraint, parsing calls from the output, their responses."""
