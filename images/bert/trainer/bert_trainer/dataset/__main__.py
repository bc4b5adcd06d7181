import sys

from bert_trainer.dataset.prepare import main

sys.exit(main())
