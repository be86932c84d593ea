import sys

from model_service.server import main
from pagedkv.serving import exit_process

exit_process(main(sys.argv[1:]))
