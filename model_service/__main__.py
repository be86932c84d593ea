import sys

from model_service.server import main

sys.exit(main(sys.argv[1:]))
