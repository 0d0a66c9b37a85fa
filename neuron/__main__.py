from neuron.entrypoints.cli import main

raise SystemExit(main())
