from radixserve.cli import main

main()
