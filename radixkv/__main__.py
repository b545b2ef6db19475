"""`python -m radixkv ...` is the same as the `radixkv` console script."""

from radixkv.cli import main

raise SystemExit(main())
