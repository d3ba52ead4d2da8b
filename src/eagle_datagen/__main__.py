from eagle_datagen.cli import main

main()
