"""Quality harness: perplexity over a corpus shipped in the repo (`tokenhaul eval ppl`)."""
