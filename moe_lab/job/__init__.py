"""One sweep point's life: launch the ranks (``launcher``), run the point and record it (``lifecycle``), the
training loop (``trainer``) and signals that stop it at a step (``interrupt``)."""
